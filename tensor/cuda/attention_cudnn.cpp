#include "tensor/cuda/attention_cudnn.h"

#include <atomic>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>

#include "tensor/cuda/attention.h"
#include "tensor/cuda/cudnn_handle.h"
#include "tensor/debug_log.h"
#include "tensor/error.h"

#ifdef MPT_WITH_CUDNN_FRONTEND
// Graph (de)serialization is not used: its JSON library stays out.
#define CUDNN_FRONTEND_SKIP_JSON_LIB
#include <cudnn_frontend.h>
#endif

namespace mpt::cuda {
namespace {

std::atomic<bool> g_enabled{true};
thread_local std::string t_last_kernel[2];  // forward, backward

}  // namespace

void set_cudnn_attention(bool on) { g_enabled = on; }
bool cudnn_attention() { return g_enabled; }
void note_attention_kernel(bool backward, std::string what) { t_last_kernel[backward] = std::move(what); }
std::string last_attention_kernel(bool backward) { return t_last_kernel[backward]; }

#ifndef MPT_WITH_CUDNN_FRONTEND

constexpr const char* kNoFrontend =
    "this build has no cudnn-frontend (configure with its headers to use cuDNN's attention)";

std::string cudnn_attention_forward(const Launch&, const AttentionArgs&) { return kNoFrontend; }
std::string cudnn_attention_backward(const Launch&, const AttentionArgs&, const AttentionGrads&) {
  return kNoFrontend;
}

#else

namespace fe = cudnn_frontend;

namespace {

// cuDNN 9 runs causal attention forward and backward on Hopper with
// strided Q, K and V; the library a program loads at run time may be
// older than the headers it was built with, so it is asked.
constexpr size_t kOldestCudnn = 90000;

std::string runtime_refusal() {
  static const std::string refusal = [] {
    const size_t found = cudnnGetVersion();
    if (found < kOldestCudnn)
      return fmt::format("the cuDNN loaded at run time is {}, and its fused attention needs {} or newer", found,
                         kOldestCudnn);
    return std::string();
  }();
  return refusal;
}

enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kdO, kdQ, kdK, kdV };

// Everything a graph is built for: the pass, the stream handle (a handle
// belongs to one thread and device), the dtype, the sizes, the causal mask,
// the scale and every operand's strides.
using GraphKey = std::vector<int64_t>;

void add_layout(GraphKey& key, const AttentionLayout& layout) {
  key.insert(key.end(), {layout.batch, layout.head, layout.row});
}

GraphKey key_of(bool backward, cudnnHandle_t handle, const AttentionArgs& a, const AttentionGrads* g) {
  float scale = static_cast<float>(a.scale);
  int32_t scale_bits = 0;
  std::memcpy(&scale_bits, &scale, sizeof scale);
  GraphKey key{backward,     reinterpret_cast<int64_t>(handle), static_cast<int64_t>(a.dtype), a.batch, a.heads, a.len,
               a.head_dim, a.causal,                          scale_bits};
  for (const AttentionLayout* l : {&a.q_layout, &a.k_layout, &a.v_layout, &a.out_layout}) add_layout(key, *l);
  if (g)
    for (const AttentionLayout* l : {&g->grad_out_layout, &g->grad_q_layout, &g->grad_k_layout, &g->grad_v_layout})
      add_layout(key, *l);
  return key;
}

// A built graph and its workspace, or why cuDNN refused the shape.
struct BuiltGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace = 0;
  std::string refusal;
};

std::shared_ptr<fe::graph::Tensor_attributes> operand(fe::graph::Graph& graph, const char* name, Uid uid,
                                                      const AttentionArgs& a, const AttentionLayout& l) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim({a.batch, a.heads, a.len, a.head_dim})
                          .set_stride({l.batch, l.head, l.row, 1}));
}

void mark_output(const std::shared_ptr<fe::graph::Tensor_attributes>& t, Uid uid, const AttentionArgs& a,
                 const AttentionLayout& l) {
  t->set_output(true).set_uid(uid).set_dim({a.batch, a.heads, a.len, a.head_dim}).set_stride({l.batch, l.head, l.row, 1});
}

// The log-sum-exp of each row, cuDNN's "stats": f32 [B, H, T, 1],
// contiguous, as the own kernels keep it, so either backward reads either
// forward's.
void mark_stats(const std::shared_ptr<fe::graph::Tensor_attributes>& t, const AttentionArgs& a) {
  t->set_uid(kStats)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim({a.batch, a.heads, a.len, 1})
      .set_stride({a.heads * a.len, a.len, 1, 1});
}

std::shared_ptr<fe::graph::Graph> new_graph(DType dtype) {
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(dtype == DType::bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return graph;
}

std::shared_ptr<fe::graph::Graph> forward_graph(const AttentionArgs& a) {
  auto graph = new_graph(a.dtype);
  auto q = operand(*graph, "q", kQ, a, a.q_layout);
  auto k = operand(*graph, "k", kK, a, a.k_layout);
  auto v = operand(*graph, "v", kV, a, a.v_layout);
  auto options = fe::graph::SDPA_attributes()
                     .set_name("attention")
                     .set_generate_stats(true)
                     .set_causal_mask(a.causal)
                     .set_attn_scale(static_cast<float>(a.scale));
  auto [out, stats] = graph->sdpa(q, k, v, options);
  mark_output(out, kO, a, a.out_layout);
  stats->set_output(true);
  mark_stats(stats, a);
  return graph;
}

std::shared_ptr<fe::graph::Graph> backward_graph(const AttentionArgs& a, const AttentionGrads& g) {
  auto graph = new_graph(a.dtype);
  auto q = operand(*graph, "q", kQ, a, a.q_layout);
  auto k = operand(*graph, "k", kK, a, a.k_layout);
  auto v = operand(*graph, "v", kV, a, a.v_layout);
  auto out = operand(*graph, "out", kO, a, a.out_layout);
  auto grad_out = operand(*graph, "grad_out", kdO, a, g.grad_out_layout);
  auto stats = graph->tensor(fe::graph::Tensor_attributes().set_name("stats"));
  mark_stats(stats, a);
  auto options = fe::graph::SDPA_backward_attributes()
                     .set_name("attention_backward")
                     .set_causal_mask(a.causal)
                     .set_attn_scale(static_cast<float>(a.scale));
  auto [grad_q, grad_k, grad_v] = graph->sdpa_backward(q, k, v, out, grad_out, stats, options);
  mark_output(grad_q, kdQ, a, g.grad_q_layout);
  mark_output(grad_k, kdK, a, g.grad_k_layout);
  mark_output(grad_v, kdV, a, g.grad_v_layout);
  return graph;
}

// Validation, cuDNN's heuristics, the support check and the plan: no GPU
// work, so this may run while a CUDA graph is being captured.
BuiltGraph build(cudnnHandle_t handle, const std::function<std::shared_ptr<fe::graph::Graph>()>& describe) {
  BuiltGraph built;
  try {
    built.graph = describe();
    fe::graph::Graph& graph = *built.graph;
    // Each step runs only while the ones before it succeeded.
    auto step = [&](const char* what, fe::error_t status) {
      if (!status.is_good()) built.refusal = fmt::format("{}: {}", what, status.get_message());
      return status.is_good();
    };
    step("validate", graph.validate()) && step("build_operation_graph", graph.build_operation_graph(handle)) &&
        step("create_execution_plans", graph.create_execution_plans({fe::HeurMode_t::A})) &&
        step("check_support", graph.check_support(handle)) && step("build_plans", graph.build_plans(handle)) &&
        step("get_workspace_size", graph.get_workspace_size(built.workspace));
  } catch (const std::exception& e) {
    built.refusal = e.what();
  }
  if (!built.refusal.empty()) built.graph.reset();
  return built;
}

std::string describe_shape(const AttentionArgs& a) {
  return fmt::format("{} [B={}, H={}, T={}, D={}]{}", dtype_name(a.dtype), a.batch, a.heads, a.len, a.head_dim,
                     a.causal ? " causal" : "");
}

// The graph for `key`, built on first use; shared, as a map entry's address
// would not survive another thread's insertion without the lock.
std::shared_ptr<const BuiltGraph> graph_for(const GraphKey& key, const char* pass, const AttentionArgs& a,
                                            cudnnHandle_t handle,
                                            const std::function<std::shared_ptr<fe::graph::Graph>()>& describe) {
  static std::mutex mutex;
  static std::map<GraphKey, std::shared_ptr<const BuiltGraph>> graphs;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (auto it = graphs.find(key); it != graphs.end()) return it->second;
  }
  auto built = std::make_shared<const BuiltGraph>(build(handle, describe));
  if (built->refusal.empty())
    debug_log("attention", fmt::format("cuDNN {} graph for {}: workspace {} bytes", pass, describe_shape(a),
                                       built->workspace));
  else
    debug_log("attention",
              fmt::format("cuDNN refuses the {} of {}, the own kernel runs it: {}", pass, describe_shape(a),
                          built->refusal));
  std::lock_guard<std::mutex> lock(mutex);
  return graphs.emplace(key, std::move(built)).first->second;
}

void execute(const BuiltGraph& built, cudnnHandle_t handle, const Launch& l,
             std::unordered_map<int64_t, void*>& pointers) {
  const CudnnWorkspace workspace(l.device, static_cast<size_t>(built.workspace), l.stream);
  fe::error_t status = built.graph->execute(handle, pointers, workspace.ptr);
  // Some of its kernels may have run: not a shape to hand to another kernel.
  if (!status.is_good()) throw DeviceError("cuDNN attention failed to run: " + status.get_message());
}

constexpr int kOwnKernelsUpToLength = 256, kOwnKernelsUpToHeadSize = 64;

// Why this pass cannot go to cuDNN, found before asking cuDNN, or "".
std::string general_refusal(const AttentionArgs& a) {
  if (!g_enabled) return "cuDNN attention is turned off";
  // Seen on an H100 with cuDNN 9.14: a negative scale gives non-finite
  // outputs, though the graph validates (the own kernels take either sign).
  if (!(a.scale > 0)) return fmt::format("cuDNN's fused attention takes a positive scale, not {}", a.scale);
  // Short sequences run faster on the own kernels, which are also
  // deterministic (cuDNN's backward sums dQ with atomics). Measured on an
  // H100 at head size 64: gpt_mini's step (T = 256) 5.23-5.24 ms with the
  // own kernels against 5.36 ms with cuDNN's, GPT-2 small's (T = 1024)
  // 38.1-38.3 ms against 36.4-36.5 ms.
  if (a.len <= kOwnKernelsUpToLength && a.head_dim <= kOwnKernelsUpToHeadSize)
    return fmt::format("sequences of at most {} positions at head sizes up to {} run faster on the own kernels",
                       kOwnKernelsUpToLength, kOwnKernelsUpToHeadSize);
  return runtime_refusal();
}

}  // namespace

std::string cudnn_attention_forward(const Launch& l, const AttentionArgs& a) {
  if (std::string why = general_refusal(a); !why.empty()) return why;
  const cudnnHandle_t handle = cudnn_handle(l.device);
  auto built = graph_for(key_of(false, handle, a, nullptr), "forward", a, handle, [&] { return forward_graph(a); });
  if (!built->graph) return "cuDNN refuses the shape: " + built->refusal;
  std::unordered_map<int64_t, void*> pointers{{kQ, const_cast<void*>(a.q)},
                                              {kK, const_cast<void*>(a.k)},
                                              {kV, const_cast<void*>(a.v)},
                                              {kO, a.out},
                                              {kStats, a.lse}};
  execute(*built, handle, l, pointers);
  return "";
}

std::string cudnn_attention_backward(const Launch& l, const AttentionArgs& a, const AttentionGrads& g) {
  if (std::string why = general_refusal(a); !why.empty()) return why;
  const cudnnHandle_t handle = cudnn_handle(l.device);
  auto built = graph_for(key_of(true, handle, a, &g), "backward", a, handle, [&] { return backward_graph(a, g); });
  if (!built->graph) return "cuDNN refuses the shape: " + built->refusal;
  std::unordered_map<int64_t, void*> pointers{
      {kQ, const_cast<void*>(a.q)}, {kK, const_cast<void*>(a.k)},        {kV, const_cast<void*>(a.v)},
      {kO, a.out},                  {kStats, a.lse},                     {kdO, const_cast<void*>(g.grad_out)},
      {kdQ, g.grad_q},              {kdK, g.grad_k},                     {kdV, g.grad_v}};
  execute(*built, handle, l, pointers);
  return "";
}

#endif

}  // namespace mpt::cuda
