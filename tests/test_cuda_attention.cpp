// Fused attention on the GPU through cuDNN's graph API and through the own
// kernels, each against the composed math in f32 on the CPU on fresh random
// inputs: q, k and v read in place from one fused projection (the layout a
// GPT block hands over, at GPT-2 small's sizes too), lengths that no tile
// divides, with and without the causal mask; the two paths' row
// statistics agree, so either backward takes either forward's; graphs
// captured into a CUDA graph replay as run eagerly; and the kernel that ran
// is said, with the reason where cuDNN did not take a shape.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "autograd/engine.h"
#include "autograd/ops.h"
#include "tensor/backend_settings.h"
#include "tensor/graph.h"
#include "tensor/ops.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

using testing::host_f64;
using testing::rel_error;

const Device kGPU("cuda:0");

// cuDNN attention on or off for one test, as it was after.
class CudnnAttentionSetting {
 public:
  explicit CudnnAttentionSetting(bool on) : before_(cudnn_attention()) { set_cudnn_attention(on); }
  ~CudnnAttentionSetting() { set_cudnn_attention(before_); }

 private:
  bool before_;
};

struct Geometry {
  int64_t b, t, h, d;
  bool causal;
};

// q, k, v [B, H, T, D] as CausalSelfAttention cuts them from one [B, T, 3C]
// projection, and the output joined back to [B, T, C].
Tensor attend(const Tensor& qkv, const Geometry& g) {
  std::vector<Tensor> parts = split(qkv, g.h * g.d, 2);
  for (Tensor& p : parts) p = transpose(reshape(p, {g.b, g.t, g.h, g.d}), 1, 2);
  const Tensor y = scaled_dot_product_attention(parts[0], parts[1], parts[2], g.causal);
  return reshape(transpose(y, 1, 2), {g.b, g.t, g.h * g.d});
}

struct AttentionRun {
  std::vector<double> out, grad;
  std::string forward_kernel, backward_kernel;
};

AttentionRun run_on(const Device& device, const Tensor& qkv16, const Tensor& weight16, const Geometry& g) {
  const DType dtype = device.is_cpu() ? DType::f32 : qkv16.dtype();
  const Tensor qkv = prim::to(prim::to(qkv16, dtype), device).set_requires_grad(true);
  const Tensor y = attend(qkv, g);
  AttentionRun r;
  r.forward_kernel = last_attention_kernel(false);
  backward(sum(mul(y, prim::to(prim::to(weight16, dtype), device))));
  r.backward_kernel = last_attention_kernel(true);
  r.out = host_f64(y);
  r.grad = host_f64(qkv.grad());
  return r;
}

TEST(CudaAttention, BothKernelsMatchTheCpuAndCudnnTakesTheLongSequences) {
  MPT_SKIP_WITHOUT_CUDA();
  const Geometry geometries[] = {
      {2, 1024, 12, 64, true},  // GPT-2 small's attention (a batch of 2)
      {4, 256, 6, 64, true},    // gpt_mini's
      {2, 100, 3, 64, true},    {1, 130, 2, 32, false}, {2, 64, 1, 128, true},
      {1, 7, 2, 64, true},      {3, 1000, 2, 128, true}, {1, 1, 4, 64, true},
  };
  for (DType dt : {DType::bf16, DType::f16})
    for (const Geometry& g : geometries) {
      const uint64_t seed = testing::fresh_seed();
      const std::string shape = fmt::format("{} [B={}, T={}, H={}, D={}]{}", dtype_name(dt), g.b, g.t, g.h, g.d,
                                            g.causal ? " causal" : "");
      SCOPED_TRACE(::testing::Message() << "seed " << seed << " " << shape);
      Generator gen(seed);
      const Tensor qkv = randn({g.b, g.t, 3 * g.h * g.d}, dt, kCPU, &gen);
      const Tensor weight = randn({g.b, g.t, g.h * g.d}, dt, kCPU, &gen);
      const AttentionRun cpu = run_on(kCPU, qkv, weight, g);
      const double tol = dt == DType::f16 ? 5e-3 : 3e-2;
      for (bool cudnn : {true, false}) {
        CudnnAttentionSetting setting(cudnn);
        const AttentionRun gpu = run_on(kGPU, qkv, weight, g);
        std::printf("%s, cuDNN %s: forward %s, backward %s\n", shape.c_str(), cudnn ? "on" : "off",
                    gpu.forward_kernel.c_str(), gpu.backward_kernel.c_str());
        EXPECT_LE(rel_error(gpu.out, cpu.out), tol) << "forward, cuDNN " << cudnn << ": " << gpu.forward_kernel;
        EXPECT_LE(rel_error(gpu.grad, cpu.grad), 2 * tol) << "gradient, cuDNN " << cudnn << ": "
                                                          << gpu.backward_kernel;
        if (!cudnn) {
          EXPECT_EQ(gpu.forward_kernel, "own (cuDNN attention is turned off)");
          EXPECT_EQ(gpu.backward_kernel, "own (cuDNN attention is turned off)");
        } else if (g.t > 256) {
          // The long sequences are what the cuDNN path is for.
          EXPECT_EQ(gpu.forward_kernel, "cudnn");
          EXPECT_EQ(gpu.backward_kernel, "cudnn");
        } else if (g.d <= 64) {
          // Short ones run faster on the own kernels.
          const std::string own = "own (sequences of at most 256 positions at head sizes up to 64 run faster on "
                                  "the own kernels)";
          EXPECT_EQ(gpu.forward_kernel, own);
          EXPECT_EQ(gpu.backward_kernel, own);
        }
      }
    }
}

// cuDNN's row statistics are the own kernels' log-sum-exp, so a forward of
// one and a backward of the other give the same gradients.
TEST(CudaAttention, EitherBackwardTakesEitherForward) {
  MPT_SKIP_WITHOUT_CUDA();
  const int64_t B = 2, H = 4, T = 300, D = 64;
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  std::vector<Tensor> qkv;
  for (int i = 0; i < 4; ++i) qkv.push_back(randn({B, H, T, D}, DType::bf16, kGPU, &gen));
  const Tensor& grad_out = qkv[3];
  const double scale = 0.125;
  auto forward = [&](bool cudnn) {
    CudnnAttentionSetting setting(cudnn);
    auto result = prim::attention_forward(qkv[0], qkv[1], qkv[2], true, scale);
    EXPECT_EQ(last_attention_kernel(false) == "cudnn", cudnn) << last_attention_kernel(false);
    return result;
  };
  auto backward_of = [&](bool cudnn, const Tensor& out, const Tensor& lse) {
    CudnnAttentionSetting setting(cudnn);
    auto grads = prim::attention_backward(qkv[0], qkv[1], qkv[2], out, lse, grad_out, true, scale);
    EXPECT_EQ(last_attention_kernel(true) == "cudnn", cudnn) << last_attention_kernel(true);
    return grads;
  };
  const auto [out_cudnn, lse_cudnn] = forward(true);
  const auto [out_own, lse_own] = forward(false);
  EXPECT_LE(rel_error(host_f64(lse_cudnn), host_f64(lse_own)), 1e-5) << "row statistics";
  EXPECT_LE(rel_error(host_f64(out_cudnn), host_f64(out_own)), 1e-2);
  const std::vector<Tensor> reference = backward_of(false, out_own, lse_own);
  for (bool forward_cudnn : {true, false})
    for (bool backward_cudnn : {true, false}) {
      SCOPED_TRACE(::testing::Message() << "forward cuDNN " << forward_cudnn << ", backward cuDNN " << backward_cudnn);
      const std::vector<Tensor> grads = forward_cudnn ? backward_of(backward_cudnn, out_cudnn, lse_cudnn)
                                                      : backward_of(backward_cudnn, out_own, lse_own);
      for (int i = 0; i < 3; ++i) EXPECT_LE(rel_error(host_f64(grads[i]), host_f64(reference[i])), 2e-2) << i;
    }
}

// cuDNN's kernels give non-finite outputs for a negative scale: the own
// kernels run it, and say why.
TEST(CudaAttention, ANegativeScaleRunsOnTheOwnKernels) {
  MPT_SKIP_WITHOUT_CUDA();
  CudnnAttentionSetting setting(true);
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  std::vector<Tensor> cpu, gpu;
  for (int i = 0; i < 3; ++i) {
    const Tensor x = randn({2, 3, 80, 64}, DType::bf16, kCPU, &gen);
    cpu.push_back(prim::to(x, DType::f32));
    gpu.push_back(prim::to(x, kGPU));
  }
  const Tensor expected = scaled_dot_product_attention(cpu[0], cpu[1], cpu[2], false, -0.3);
  const Tensor got = scaled_dot_product_attention(gpu[0], gpu[1], gpu[2], false, -0.3);
  EXPECT_EQ(last_attention_kernel(false), "own (cuDNN's fused attention takes a positive scale, not -0.3)");
  EXPECT_LE(rel_error(host_f64(got), host_f64(expected)), 3e-2);
}

// A training step of attention alone captured into a CUDA graph: the
// cuDNN graphs are built while capturing (no GPU work in that) and each
// replay on new inputs gives what an eager run gives.
TEST(CudaAttention, CudnnGraphsReplayInACapturedStep) {
  MPT_SKIP_WITHOUT_CUDA();
  const Geometry g{2, 512, 4, 64, true};
  CudnnAttentionSetting setting(true);
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  Tensor out, grad;
  CapturedStep captured(kGPU, [&](const std::vector<Tensor>& in) {
    const Tensor qkv = prim::clone(in[0]).set_requires_grad(true);
    out = attend(qkv, g);
    backward(sum(mul(out, in[1])));
    grad = qkv.grad();
  }, 1);
  for (int step = 0; step < 4; ++step) {
    const Tensor qkv = randn({g.b, g.t, 3 * g.h * g.d}, DType::f16, kGPU, &gen);
    const Tensor weight = randn({g.b, g.t, g.h * g.d}, DType::f16, kGPU, &gen);
    captured.run({qkv, weight});
    const std::vector<double> replayed_out = host_f64(out), replayed_grad = host_f64(grad);
    const AttentionRun eager = run_on(kGPU, qkv, weight, g);
    EXPECT_EQ(eager.forward_kernel, "cudnn");
    // The backward's dQ is summed with atomics in an order that may vary.
    EXPECT_EQ(replayed_out, eager.out) << "step " << step;
    EXPECT_LE(rel_error(replayed_grad, eager.grad), 1e-3) << "step " << step;
  }
  EXPECT_EQ(captured.fallback_reason(), "");
  EXPECT_EQ(captured.replays(), 3);
}

}  // namespace
}  // namespace mpt
