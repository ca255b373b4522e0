// Differentiable ops on the GPU against the CPU: forward values and the
// gradients of every input, on fresh random inputs, per dtype tolerance.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "amp/autocast.h"
#include "autograd/beside.h"
#include "autograd/function.h"
#include "autograd/ops.h"
#include "autograd/engine.h"
#include "models/gpt.h"
#include "models/layers.h"
#include "models/sequential.h"
#include "tensor/cuda/conv_cudnn.h"
#include "tensor/memory.h"
#include "tensor/stream.h"
#include "tests/layer_norm_narrow_copy.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

using testing::host_f64;
using testing::rel_error;
using Fn = std::function<Tensor(const std::vector<Tensor>&)>;

// Runs f on CPU copies and GPU copies of the same inputs, backpropagates
// the same random output weights, and compares outputs and gradients.
void expect_gpu_matches_cpu(const Fn& f, const std::vector<Shape>& shapes, DType dt, double tol, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " dtype " << dtype_name(dt));
  Generator gen(seed);
  std::vector<Tensor> cpu, gpu;
  for (const Shape& s : shapes) {
    Tensor c = randn(s, dt, kCPU, &gen);
    Tensor g = prim::to(c, Device("cuda:0"));
    cpu.push_back(c.set_requires_grad(true));
    gpu.push_back(g.set_requires_grad(true));
  }
  const Tensor out_cpu = f(cpu), out_gpu = f(gpu);
  ASSERT_EQ(out_gpu.device(), Device("cuda:0"));
  ASSERT_EQ(out_gpu.dtype(), out_cpu.dtype());
  EXPECT_LE(rel_error(host_f64(out_gpu), host_f64(out_cpu)), tol) << "forward";
  const Tensor w = randn(out_cpu.shape(), out_cpu.dtype(), kCPU, &gen);
  backward(sum(mul(out_cpu, w)));
  backward(sum(mul(out_gpu, prim::to(w, Device("cuda:0")))));
  for (size_t i = 0; i < cpu.size(); ++i) {
    ASSERT_TRUE(gpu[i].grad().defined()) << "input " << i;
    EXPECT_EQ(gpu[i].grad().device(), Device("cuda:0"));
    EXPECT_LE(rel_error(host_f64(gpu[i].grad()), host_f64(cpu[i].grad())), tol) << "gradient of input " << i;
  }
}

struct Case {
  const char* name;
  Fn f;
  std::vector<Shape> shapes;
};

std::vector<Case> cases() {
  using V = std::vector<Tensor>;
  return {
      {"add", [](const V& v) { return v[0] + v[1]; }, {{4, 1, 8}, {3, 8}}},
      {"mul", [](const V& v) { return v[0] * v[1]; }, {{4, 3, 8}, {8}}},
      {"div", [](const V& v) { return v[0] / (v[1] * v[1] + 1.0); }, {{4, 8}, {4, 8}}},
      {"tanh_sigmoid", [](const V& v) { return tanh(v[0]) + sigmoid(v[0]); }, {{5, 7}}},
      {"relu_gelu", [](const V& v) { return relu(v[0]) + gelu(v[0]) + gelu(v[0], GeluApprox::tanh); }, {{5, 7}}},
      {"exp_log", [](const V& v) { return log(exp(v[0]) + 1.0); }, {{5, 7}}},
      {"sum_mean", [](const V& v) { return sum(v[0], {1}) + mean(v[0], {1}); }, {{6, 9, 4}}},
      {"matmul", [](const V& v) { return matmul(v[0], v[1]); }, {{3, 16, 32}, {32, 24}}},
      {"matmul_batched", [](const V& v) { return matmul(v[0], transpose(v[1], -1, -2)); }, {{2, 3, 8, 16}, {2, 3, 8, 16}}},
      {"linear", [](const V& v) { return linear(v[0], v[1], v[2]); }, {{4, 5, 32}, {16, 32}, {16}}},
      {"linear_relu", [](const V& v) { return linear_relu(v[0], v[1], v[2]); }, {{4, 5, 32}, {16, 32}, {16}}},
      {"linear_relu_no_bias", [](const V& v) { return linear_relu(v[0], v[1]); }, {{7, 32}, {24, 32}}},
      {"softmax", [](const V& v) { return softmax(v[0], -1); }, {{6, 33}}},
      {"log_softmax", [](const V& v) { return log_softmax(v[0], 1); }, {{6, 33}}},
      {"layer_norm", [](const V& v) { return layer_norm(v[0], v[1], v[2]); }, {{4, 6, 48}, {48}, {48}}},
      {"layer_norm_wide_rows", [](const V& v) { return layer_norm(v[0], v[1], v[2]); }, {{3, 384}, {384}, {384}}},
      {"layer_norm_1000", [](const V& v) { return layer_norm(v[0], v[1], Tensor()); }, {{5, 1000}, {1000}}},
      {"layer_norm_701", [](const V& v) { return layer_norm(v[0], Tensor(), v[1]); }, {{6, 701}, {701}}},
      {"layer_norm_rows_off_alignment",  // rows one element past 16-byte alignment: one column at a time
       [](const V& v) { return layer_norm(reshape(slice(v[0], 0, 1, 257), {4, 64}), v[1], v[2]); },
       {{257}, {64}, {64}}},
      {"layer_norm_300", [](const V& v) { return layer_norm(v[0], v[1], v[2]); }, {{300, 300}, {300}, {300}}},
      {"layer_norm_many_rows", [](const V& v) { return layer_norm(v[0], Tensor(), v[1]); }, {{3000, 2, 40}, {40}}},
      {"layer_norm_with_skip",
       [](const V& v) {
         const auto [skip, normed] = layer_norm_with_skip(v[0], v[1], v[2]);
         return skip * normed;
       },
       {{4, 6, 48}, {48}, {48}}},
      {"silu", [](const V& v) { return silu(v[0]); }, {{7, 33}}},
      {"batch_norm_batch_statistics",
       [](const V& v) {
         const Tensor running_mean = zeros({3}, DType::f32, v[0].device()), running_var = ones({3}, DType::f32, v[0].device());
         return batch_norm(v[0], running_mean, running_var, v[1], v[2], true);
       },
       {{4, 3, 5, 6}, {3}, {3}}},
      {"batch_norm_running_statistics",
       [](const V& v) {
         const Tensor running_mean = full({3}, 0.25, DType::f32, v[0].device());
         return batch_norm(v[0], running_mean, full({3}, 2.0, DType::f32, v[0].device()), v[1], v[2], false);
       },
       {{7, 3}, {3}, {3}}},
      {"attention", [](const V& v) { return scaled_dot_product_attention(v[0], v[1], v[2], true); },
       {{2, 3, 16, 8}, {2, 3, 16, 8}, {2, 3, 16, 8}}},
      {"attention_with_masks",  // a u8 mask with the causal one, a float mask (with its gradient), a dead query
       [](const V& v) {
         const std::vector<uint8_t> keep{1, 1, 1, 1, 1, 1, 1, 0, 1, 0, 0, 1};  // batch 1 leaves out keys 1, 3, 4
         const Tensor mask = prim::to(from_vector(keep, {2, 1, 1, 6}, DType::u8), v[0].device());
         const std::vector<uint8_t> rows{1, 1, 0, 1, 1, 1};  // query 2 sees no key: zeros
         const Tensor dead_row = prim::to(from_vector(rows, {6, 1}, DType::u8), v[0].device());
         return scaled_dot_product_attention(v[0], v[1], v[2], true, std::nullopt, mask) +
                scaled_dot_product_attention(v[0], v[1], v[2], false, std::nullopt, v[3]) +
                scaled_dot_product_attention(v[0], v[1], v[2], false, std::nullopt, dead_row);
       },
       {{2, 2, 6, 8}, {2, 2, 6, 8}, {2, 2, 6, 8}, {6, 6}}},
      {"attention_queries_at_the_keys_end",  // a key/value cache's read: fewer queries than keys
       [](const V& v) { return scaled_dot_product_attention(v[0], v[1], v[2], true); },
       {{2, 3, 5, 64}, {2, 3, 19, 64}, {2, 3, 19, 64}}},
      {"attention_split_from_one_block",  // head size 64: the fused kernels' (16 bits)
       [](const V& v) {
         std::vector<Tensor> qkv = split(v[0], 128, 2);  // [2, 24, 384] -> q | k | v as [2, 2, 24, 64]
         for (Tensor& t : qkv) t = transpose(reshape(t, {2, 24, 2, 64}), 1, 2);
         return scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], true);
       },
       {{2, 24, 384}}},
      {"reshape_permute_slice",
       [](const V& v) { return slice(permute(reshape(v[0], {4, 6, 5}), {2, 0, 1}), 1, 1, 4); }, {{24, 5}}},
      {"conv2d", [](const V& v) { return conv2d(v[0], v[1], v[2], Conv2dParams{1, 1, 1, 1}); },
       {{2, 3, 9, 7}, {5, 3, 3, 3}, {5}}},
      {"conv2d_strided_dilated",
       [](const V& v) { return conv2d(v[0], v[1], Tensor(), Conv2dParams{2, 1, 0, 2, 2, 1}); },
       {{3, 4, 11, 10}, {6, 4, 3, 2}}},
      {"max_pool2d", [](const V& v) { return max_pool2d(v[0]); }, {{2, 3, 8, 9}}},
      {"max_pool2d_tiled", [](const V& v) { return max_pool2d(v[0]); }, {{2, 3, 8, 10}}},
      {"max_pool2d_strided_past_the_kernel", [](const V& v) { return max_pool2d(v[0], Pool2dParams{2, 2, 3, 3, 1, 0}); },
       {{2, 3, 10, 11}}},
      {"max_pool2d_overlapping", [](const V& v) { return max_pool2d(v[0], Pool2dParams{3, 3, 2, 2, 1, 1}); },
       {{2, 3, 9, 8}}},
      {"cat_split",
       [](const V& v) {
         auto parts = split(cat({v[0], v[1]}, 0), 3, 0);
         return parts[0] * parts[1];
       },
       {{4, 5}, {2, 5}}},
  };
}

TEST(CudaAutograd, OpsMatchTheCpuInF32) {
  MPT_SKIP_WITHOUT_CUDA();
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    expect_gpu_matches_cpu(c.f, c.shapes, DType::f32, 2e-5, testing::fresh_seed());
  }
}

TEST(CudaAutograd, OpsMatchTheCpuInHalfTypes) {
  MPT_SKIP_WITHOUT_CUDA();
  for (DType dt : {DType::f16, DType::bf16})
    for (const Case& c : cases()) {
      if (std::string(c.name) == "exp_log" || std::string(c.name) == "div") continue;  // ill-conditioned in 16 bits
      SCOPED_TRACE(c.name);
      expect_gpu_matches_cpu(c.f, c.shapes, dt, dt == DType::f16 ? 1e-2 : 5e-2, testing::fresh_seed());
    }
}

// Results the two devices compute in f32 and round to dt: equal, or one step
// of dt apart where they straddle a rounding boundary (plus f32's own
// difference, 2e-5 of 1 + |cpu|).
void expect_within_a_rounding(const std::vector<double>& gpu, const std::vector<double>& cpu, DType dt,
                              const std::string& what) {
  const double step = std::ldexp(1.0, dt == DType::bf16 ? -7 : dt == DType::f16 ? -10 : -23);
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  for (size_t i = 0; i < gpu.size(); ++i)
    if (!(std::fabs(gpu[i] - cpu[i]) <= step * std::fabs(cpu[i]) + 2e-5 * (1 + std::fabs(cpu[i])))) {
      ADD_FAILURE() << what << ": element " << i << ": gpu " << gpu[i] << ", cpu " << cpu[i];
      return;
    }
}

// A norm written straight in 16 bits by the fused kernel (its f32 result
// rounded on the store) is, bit for bit, the fused f32 norm and then the
// cast, forward and in every gradient (the kernel widens the 16-bit
// gradient as the cast's backward would); and it is the CPU's norm (held to
// f64 in test_autograd) up to one 16-bit rounding, with gradients at f32
// tolerance. A 16-bit input asked for f32 takes the composed path there too.
TEST(CudaAutograd, LayerNormWrittenInSixteenBitsIsTheNormThenTheCastAndTheCpus) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  const Device gpu("cuda:0");
  // Rows of 384, and GPT-2 small's 768 in more rows than the backward's
  // warps (a warp then loads its next row ahead of the one it works on).
  for (const Shape& shape : {Shape{3, 5, 384}, Shape{2, 1100, 768}})
    for (DType low : {DType::f16, DType::bf16}) {
      const int64_t d = shape.back();
      SCOPED_TRACE(::testing::Message() << dtype_name(low) << " " << shape_str(shape));
      const Tensor x0 = randn(shape, DType::f32, kCPU, &gen), w0 = randn({d}, DType::f32, kCPU, &gen),
                   b0 = randn({d}, DType::f32, kCPU, &gen), dy = randn(shape, low, kCPU, &gen);
      ASSERT_TRUE(prim::fused_layer_norm_available(prim::to(x0, gpu), prim::to(w0, gpu), prim::to(b0, gpu), low));
      // {y, dx, dw, db}, the norm written in 16 bits (direct) or in f32 and cast.
      auto run = [&](const Device& device, bool direct) {
        Tensor x = prim::to(prim::clone(x0), device), w = prim::to(prim::clone(w0), device),
               b = prim::to(prim::clone(b0), device);
        for (Tensor* t : {&x, &w, &b}) t->set_requires_grad(true);
        const Tensor y = direct ? layer_norm(x, w, b, 1e-5, low) : to(layer_norm(x, w, b), low);
        EXPECT_EQ(y.dtype(), low);
        backward(y, prim::to(dy, device));
        return std::vector<std::vector<double>>{host_f64(y), host_f64(x.grad()), host_f64(w.grad()),
                                                host_f64(b.grad())};
      };
      const auto direct = run(gpu, true), cast = run(gpu, false), cpu = run(kCPU, true);
      const char* what[] = {"forward", "gradient of x", "gradient of the weight", "gradient of the bias"};
      for (size_t i = 0; i < 4; ++i)
        EXPECT_EQ(direct[i], cast[i]) << what[i] << ": written in 16 bits against the cast";
      expect_within_a_rounding(direct[0], cpu[0], low, "forward against the cpu");
      for (size_t i = 1; i < 4; ++i) EXPECT_LE(rel_error(direct[i], cpu[i]), 2e-5) << what[i] << " against the cpu";

      const Tensor x16 = prim::to(x0, low), w16 = prim::to(w0, low), b16 = prim::to(b0, low);
      const Tensor asked = layer_norm(prim::to(x16, gpu), prim::to(w16, gpu), prim::to(b16, gpu), 1e-5, DType::f32);
      ASSERT_EQ(asked.dtype(), DType::f32);
      EXPECT_LE(rel_error(host_f64(asked), host_f64(layer_norm(x16, w16, b16, 1e-5, DType::f32))), 2e-5)
          << "a 16-bit input asked for f32";
    }
}

// The norm with its input passed on beside it is one node on the GPU, whose
// backward adds the skip path's gradient as it writes dx: bit for bit the
// composed expression there (x, and the norm; the engine adding x's two
// gradients), and the CPU's results (held to f64 in test_autograd) up to
// rounding, in f32 and into f16.
TEST(CudaAutograd, LayerNormWithSkipIsTheComposedExpressionAndTheCpus) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  const Device gpu("cuda:0");
  for (const Shape& shape : {Shape{4, 7, 96}, Shape{2, 1100, 768}})
    for (DType out : {DType::f32, DType::f16}) {
      const int64_t d = shape.back();
      SCOPED_TRACE(::testing::Message() << "into " << dtype_name(out) << " " << shape_str(shape));
      auto draw = [&](const Shape& s) { return randn(s, DType::f32, kCPU, &gen); };
      const Tensor x0 = draw(shape), w0 = draw({d}), b0 = draw({d}), dskip = draw(shape), dnorm = draw(shape);
      // {skip, norm, dx, dw, db}, as one node (fused) or composed.
      auto run = [&](const Device& device, bool fused) {
        Tensor x = prim::to(prim::clone(x0), device), w = prim::to(prim::clone(w0), device),
               b = prim::to(prim::clone(b0), device);
        for (Tensor* t : {&x, &w, &b}) t->set_requires_grad(true);
        Tensor skip, normed;
        if (fused) {
          std::tie(skip, normed) = layer_norm_with_skip(x, w, b, 1e-5, out);
        } else {
          skip = x;
          normed = to(layer_norm(x, w, b), out);
        }
        EXPECT_EQ(skip.dtype(), DType::f32);
        EXPECT_EQ(normed.dtype(), out);
        backward(sum(skip * prim::to(dskip, device)) + sum(to(normed, DType::f32) * prim::to(dnorm, device)));
        return std::vector<std::vector<double>>{host_f64(skip), host_f64(normed), host_f64(x.grad()),
                                                host_f64(w.grad()), host_f64(b.grad())};
      };
      const auto fused = run(gpu, true), composed = run(gpu, false), cpu = run(kCPU, true);
      const char* what[] = {"skip", "norm", "gradient of x", "gradient of the weight", "gradient of the bias"};
      for (size_t i = 0; i < 5; ++i) EXPECT_EQ(fused[i], composed[i]) << what[i] << ": one node against the composed";
      EXPECT_EQ(fused[0], cpu[0]) << "skip against the cpu";
      expect_within_a_rounding(fused[1], cpu[1], out, "norm against the cpu");
      for (size_t i = 2; i < 5; ++i) EXPECT_LE(rel_error(fused[i], cpu[i]), 2e-5) << what[i] << " against the cpu";
    }
}

// The GPU kernel's 16-bit copy of the gradient (Storage::NarrowCopy), as
// the CPU's test checks it: the cast kernel's bits, taken once. Rows of 384
// and 768 (the widths with their own register counts; 768 loads a row
// ahead) and 7 (chunks of one element).
TEST(CudaAutograd, LayerNormBackwardLeavesTheSixteenBitCopyTheCastMakes) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  for (DType out : {DType::f16, DType::bf16})
    for (int64_t d : {7, 384, 768})
      for (bool with_more : {false, true}) {
        testing::check_layer_norm_narrow_copy(Device("cuda:0"), gen, 2200, d, out, with_more);
        if (::testing::Test::HasFatalFailure()) return;
      }
}

// The fused batch norm (an f32, f16 or bf16 input with f32 per-channel
// tensors) against the CPU's composed one on the same values: the output,
// every gradient and the running statistics, with batch statistics and
// with running ones. The shapes give the kernels' every case: spatial sizes
// read in 16-byte packs (256), in narrower ones (6, 14) and one at a time
// (99; and 1: an [N, C] input), and channels of 262144 values cut into many
// blocks. The inputs' mean is far from zero, where sums of squares would
// lose the variance.
TEST(CudaAutograd, FusedBatchNormMatchesTheCpu) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  const Device gpu("cuda:0");
  const std::vector<Shape> shapes{{8, 4, 16, 16}, {16, 6, 9, 11}, {64, 40}, {5, 3, 6}, {3, 5, 2, 7}, {256, 3, 32, 32}};
  for (DType dt : {DType::f32, DType::f16, DType::bf16})
    for (const Shape& shape : shapes)
      for (bool training : {true, false}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " " << shape_str(shape)
                                          << (training ? " batch statistics" : " running statistics"));
        const int64_t c = shape[1];
        const Tensor x0 = prim::to(prim::add_scalar(prim::mul_scalar(randn(shape, DType::f32, kCPU, &gen), 2.0), 30.0), dt);
        const Tensor w0 = randn({c}, DType::f32, kCPU, &gen), b0 = randn({c}, DType::f32, kCPU, &gen);
        const Tensor mean0 = randn({c}, DType::f32, kCPU, &gen);
        const Tensor var0 = rand({c}, DType::f32, kCPU, &gen, 0.5, 1.5);
        const Tensor dy = randn(shape, dt, kCPU, &gen);
        struct Run {
          std::vector<double> y, dx, dw, db, running_mean, running_var;
        };
        auto run = [&](const Device& device) {
          Tensor x = prim::to(prim::clone(x0), device), w = prim::to(prim::clone(w0), device),
                 b = prim::to(prim::clone(b0), device);
          const Tensor running_mean = prim::to(prim::clone(mean0), device),
                       running_var = prim::to(prim::clone(var0), device);
          for (Tensor* t : {&x, &w, &b}) t->set_requires_grad(true);
          if (device.is_cuda()) EXPECT_TRUE(prim::fused_batch_norm_available(x, running_mean, running_var, w, b));
          const Tensor y = batch_norm(x, running_mean, running_var, w, b, training, 0.1, 1e-5);
          EXPECT_EQ(y.dtype(), dt);
          backward(sum(to(y * prim::to(dy, device), DType::f32)));
          return Run{host_f64(y), host_f64(x.grad()), host_f64(w.grad()), host_f64(b.grad()),
                     host_f64(running_mean), host_f64(running_var)};
        };
        const Run g = run(gpu), cpu = run(kCPU);
        if (dt == DType::f32) {
          EXPECT_LE(rel_error(g.y, cpu.y), 2e-5) << "output";
        } else {
          expect_within_a_rounding(g.y, cpu.y, dt, "output");
        }
        const double dx_tol = dt == DType::f32 ? 1e-4 : dt == DType::f16 ? 2e-3 : 1e-2;  // a rounding of dx's dtype
        EXPECT_LE(rel_error(g.dx, cpu.dx), dx_tol) << "gradient of x";
        EXPECT_LE(rel_error(g.dw, cpu.dw), 1e-4) << "gradient of the weight";
        EXPECT_LE(rel_error(g.db, cpu.db), 1e-5) << "gradient of the bias";
        EXPECT_LE(rel_error(g.running_mean, cpu.running_mean), 1e-6) << "running mean";
        EXPECT_LE(rel_error(g.running_var, cpu.running_var), 1e-5) << "running variance";
      }
}

// bf16 autocast on the GPU. A small model (linear, gelu, layer norm, linear,
// cross-entropy) under AutocastGuard(cuda, bf16) against the same model
// under AutocastGuard(cpu, bf16): the same casts and f32 accumulation on both
// devices, which differ only where their f32 results round to neighbouring
// bf16 values. And a tiny GPT (on the GPU the fused bf16 attention and
// norms, on the CPU the composed f32 math) against f32 on the CPU, at a
// tolerance of a few bf16 roundings (2^-9 each).
TEST(CudaAutograd, Bf16AutocastMatchesTheCpu) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const Device gpu("cuda:0");
  Generator data(seed + 1);
  auto labels = [&data](int64_t n, int64_t classes) {
    std::vector<int64_t> out;
    for (double u : host_f64(rand({n}, DType::f64, kCPU, &data, 0.0, static_cast<double>(classes))))
      out.push_back(std::min<int64_t>(static_cast<int64_t>(u), classes - 1));
    return out;
  };
  struct Result {
    DType logits_dtype;
    std::vector<double> logits;
    double loss;
    std::vector<std::pair<std::string, std::vector<double>>> grads;
  };
  // One forward and backward of `model`, moved to `device`, under bf16
  // autocast there (or in f32).
  auto run = [](nn::Module& model, const Device& device, bool bf16, const Tensor& input, const Tensor& target) {
    model.to(device);
    Tensor logits, loss;
    {
      std::optional<amp::AutocastGuard> autocast;
      if (bf16) autocast.emplace(device.type, DType::bf16);
      logits = model.forward(prim::to(input, device));
      loss = cross_entropy(reshape(logits, {-1, logits.size(-1)}), prim::to(target, device));
    }
    backward(loss);
    Result r{logits.dtype(), host_f64(logits), loss.item(), {}};
    for (const auto& [name, p] : model.named_parameters()) r.grads.emplace_back(name, host_f64(p.grad()));
    return r;
  };
  // The GPU's logits, loss and every gradient against the CPU's.
  auto expect_matches = [](const Result& g, const Result& c, double logits_tolerance, double grad_tolerance) {
    EXPECT_LE(rel_error(g.logits, c.logits), logits_tolerance) << "logits";
    EXPECT_NEAR(g.loss, c.loss, 1e-2 * std::fabs(c.loss));
    ASSERT_EQ(g.grads.size(), c.grads.size());
    for (size_t i = 0; i < c.grads.size(); ++i)
      EXPECT_LE(rel_error(g.grads[i].second, c.grads[i].second), grad_tolerance) << "gradient of " << c.grads[i].first;
  };

  {
    SCOPED_TRACE("linear, gelu, layer norm, linear: against the cpu in bf16");
    auto make = [seed] {
      Generator gen(seed);
      auto m = std::make_shared<nn::Sequential>();
      m->push_back(std::make_shared<nn::Linear>(32, 64, true, &gen));
      m->push_back(std::make_shared<nn::GELU>());
      m->push_back(std::make_shared<nn::LayerNorm>(64));
      m->push_back(std::make_shared<nn::Linear>(64, 10, true, &gen));
      return m;
    };
    const Tensor x = randn({48, 32}, DType::f32, kCPU, &data);
    const Tensor target = from_vector(labels(48, 10), {48}, DType::i64);
    auto on_cpu = make(), on_gpu = make();
    const Result c = run(*on_cpu, kCPU, true, x, target), g = run(*on_gpu, gpu, true, x, target);
    EXPECT_EQ(c.logits_dtype, DType::bf16);
    EXPECT_EQ(g.logits_dtype, DType::bf16);
    expect_matches(g, c, 1e-2, 1e-2);
  }
  {
    SCOPED_TRACE("tiny GPT: against the cpu in f32");
    nn::GPTOptions o;
    o.vocab_size = 65, o.context = 32, o.d_model = 128, o.n_layers = 2, o.n_heads = 2;  // heads of 64: fused
    auto make = [seed, &o] {
      Generator gen(seed);
      return std::make_shared<nn::GPT>(o, &gen);
    };
    const Tensor idx = from_vector(labels(2 * 32, 65), {2, 32}, DType::i64);
    const Tensor target = from_vector(labels(2 * 32, 65), {2 * 32}, DType::i64);
    auto on_cpu = make(), on_gpu = make();
    const Result c = run(*on_cpu, kCPU, false, idx, target), g = run(*on_gpu, gpu, true, idx, target);
    EXPECT_EQ(c.logits_dtype, DType::f32);
    EXPECT_EQ(g.logits_dtype, DType::bf16);
    expect_matches(g, c, 5e-2, 0.1);
  }
}

// q, k and v split from one fused projection get their gradients in one
// block laid out the same way (which the split's backward takes whole);
// separate q, k and v get separate gradients.
TEST(CudaAutograd, AttentionGradientsOfOneBlockShareOneBlock) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  const Device gpu("cuda:0");
  const Tensor block = randn({2, 24, 384}, DType::f16, gpu, &gen);  // heads of 64: the fused kernels'
  std::vector<Tensor> qkv;
  for (int i = 0; i < 3; ++i)
    qkv.push_back(prim::transpose(prim::reshape(prim::slice(block, 2, 128 * i, 128 * (i + 1)), {2, 24, 2, 64}), 1, 2));
  ASSERT_TRUE(prim::fused_attention_available(qkv[0], qkv[1], qkv[2]));
  auto [out, lse] = prim::attention_forward(qkv[0], qkv[1], qkv[2], true, 0.35);
  const Tensor dy = randn(out.shape(), DType::f16, gpu, &gen);
  const std::vector<Tensor> joined = prim::attention_backward(qkv[0], qkv[1], qkv[2], out, lse, dy, true, 0.35);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(joined[i].storage(), joined[0].storage()) << i;
    EXPECT_EQ(joined[i].strides(), qkv[i].strides()) << i;
    EXPECT_EQ(joined[i].offset() - joined[0].offset(), qkv[i].offset() - qkv[0].offset()) << i;
  }
  std::vector<Tensor> apart;
  for (const Tensor& t : qkv) apart.push_back(prim::contiguous(t));
  const std::vector<Tensor> separate = prim::attention_backward(apart[0], apart[1], apart[2], out, lse, dy, true, 0.35);
  EXPECT_NE(separate[1].storage(), separate[0].storage());
  // Every gradient is summed in registers in a fixed order (no atomics): the
  // layout changes nothing, and a second run gives the same bits.
  const std::vector<Tensor> again = prim::attention_backward(qkv[0], qkv[1], qkv[2], out, lse, dy, true, 0.35);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(host_f64(joined[i]), host_f64(separate[i])) << i;
    EXPECT_EQ(host_f64(joined[i]), host_f64(again[i])) << i;
  }
}

// The same convolutions with timed algorithms instead of cuDNN's heuristic
// picks (conv_autotune on): other kernels, the same results.
TEST(CudaAutograd, ConvolutionsMatchTheCpuWithTimedAlgorithms) {
  MPT_SKIP_WITHOUT_CUDA();
  ASSERT_FALSE(cuda::conv_autotune());  // the default
  cuda::set_conv_autotune(true);
  for (const Case& c : cases()) {
    if (std::string(c.name).rfind("conv2d", 0) != 0) continue;
    SCOPED_TRACE(c.name);
    for (DType dt : {DType::f32, DType::f16})
      expect_gpu_matches_cpu(c.f, c.shapes, dt, dt == DType::f32 ? 2e-5 : 1e-2, testing::fresh_seed());
  }
  cuda::set_conv_autotune(false);
}

// Dropout on the GPU in every float type: the share dropped, the kept
// values x / (1 - p) rounded once (their sum grows by 1 / (1 - p)), and the
// gradient through the same mask.
TEST(CudaAutograd, DropoutKeepsItsRateAndScaleInEveryFloatType) {
  MPT_SKIP_WITHOUT_CUDA();
  const Device gpu("cuda:0");
  Generator gen(testing::fresh_seed());
  const int64_t n = 200000;
  const double p = 0.1;
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor x = rand({n}, dt, gpu, &gen, 1.0, 2.0).set_requires_grad(true);
    const Tensor y = dropout(x, p, true, &gen);
    ASSERT_EQ(y.dtype(), dt);
    backward(sum(y));
    const std::vector<double> in = host_f64(x), out = host_f64(y), grad = host_f64(x.grad());
    double kept_in = 0, kept_out = 0;
    int64_t dropped = 0;
    for (size_t i = 0; i < in.size(); ++i) {
      if (out[i] == 0) {
        ++dropped;
        ASSERT_EQ(grad[i], 0.0) << i;
        continue;
      }
      kept_in += in[i];
      kept_out += out[i];
      ASSERT_NEAR(grad[i], 1 / (1 - p), 1e-2) << i;
    }
    EXPECT_NEAR(static_cast<double>(dropped), p * n, 5 * std::sqrt(n * p * (1 - p)));
    EXPECT_NEAR(kept_out / kept_in, 1 / (1 - p), 3e-4 / (1 - p));
  }
}

// Convolutions where a batch or a channel count is 0, which cuDNN refuses:
// the CPU's shapes and values (sums over nothing), forward and backward.
TEST(CudaAutograd, ConvolutionsOverNothingMatchTheCpu) {
  MPT_SKIP_WITHOUT_CUDA();
  const Device gpu("cuda:0");
  const Conv2dParams p{1, 1, 1, 1};
  for (DType dt : {DType::f32, DType::f16})
    for (const auto& [xs, ws] : {std::pair<Shape, Shape>{{0, 3, 8, 8}, {4, 3, 3, 3}},
                                 {{2, 0, 8, 8}, {4, 0, 3, 3}},
                                 {{2, 3, 8, 8}, {0, 3, 3, 3}}}) {
      SCOPED_TRACE(shape_str(xs).str() + " * " + shape_str(ws).str() + " in " + dtype_name(dt));
      const Tensor x = randn(xs, dt), w = randn(ws, dt);
      const Tensor y = prim::conv2d(x, w, p), dy = randn(y.shape(), dt);
      const Tensor on_gpu = prim::conv2d(prim::to(x, gpu), prim::to(w, gpu), p);
      EXPECT_EQ(on_gpu.shape(), y.shape());
      EXPECT_EQ(host_f64(on_gpu), host_f64(y));
      const Tensor dx = prim::conv2d_backward_data(prim::to(dy, gpu), prim::to(w, gpu), xs, p);
      EXPECT_EQ(dx.shape(), xs);
      EXPECT_EQ(host_f64(dx), host_f64(prim::conv2d_backward_data(dy, w, xs, p)));
      const Tensor dw = prim::conv2d_backward_weight(prim::to(x, gpu), prim::to(dy, gpu), ws, p);
      EXPECT_EQ(dw.shape(), ws);
      EXPECT_EQ(host_f64(dw), host_f64(prim::conv2d_backward_weight(x, dy, ws, p)));
    }
}

// The ReLU in the GEMM's epilogue keeps NaN as relu() does: a NaN input
// row gives a NaN output row, the other rows what the CPU gives. Small and
// large products (cuBLASLt picks other kernels for them).
TEST(CudaAutograd, LinearReluKeepsNaNAsReluDoes) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  const Device gpu("cuda:0");
  for (DType dt : {DType::f32, DType::f16})
    for (const auto& [rows, in, out] : {std::tuple<int64_t, int64_t, int64_t>{4, 32, 16}, {512, 256, 384}}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " [" << rows << ", " << in << "] x [" << out << ", "
                                        << in << "]");
      std::vector<double> xs = host_f64(randn({rows, in}, dt, kCPU, &gen));
      xs[in + 3] = std::nan("");  // row 1
      const Tensor x = from_vector(xs, {rows, in}, dt), w = randn({out, in}, dt, kCPU, &gen),
                   b = randn({out}, dt, kCPU, &gen);
      const std::vector<double> want = host_f64(linear_relu(x, w, b));
      const std::vector<double> got =
          host_f64(linear_relu(prim::to(x, gpu), prim::to(w, gpu), prim::to(b, gpu)));
      int64_t nan_in_row_1 = 0, wrong_elsewhere = 0;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < out; ++c) {
          const double g = got[r * out + c], e = want[r * out + c];
          if (r == 1) nan_in_row_1 += std::isnan(g) && std::isnan(e);
          else wrong_elsewhere += !(std::abs(g - e) <= (dt == DType::f32 ? 1e-3 : 5e-2) * (1 + std::abs(e)));
        }
      EXPECT_EQ(nan_in_row_1, out);
      EXPECT_EQ(wrong_elsewhere, 0);
    }
}

TEST(CudaAutograd, CrossEntropyMatchesTheCpu) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = testing::fresh_seed();
  Generator gen(seed);
  const Tensor target_cpu = from_vector(std::vector<int64_t>{3, 0, 64, 17, -100, 5, 5, 1}, {8}, DType::i64);
  const Tensor target_gpu = prim::to(target_cpu, Device("cuda:0"));
  for (DType dt : {DType::f32, DType::f16, DType::bf16})
    for (Reduction r : {Reduction::mean, Reduction::sum, Reduction::none}) {
      SCOPED_TRACE(::testing::Message() << "seed " << seed << " " << dtype_name(dt) << " reduction "
                                        << static_cast<int>(r));
      Tensor lc = randn({8, 65}, dt, kCPU, &gen);
      Tensor lg = prim::to(lc, Device("cuda:0"));
      lc.set_requires_grad(true);
      lg.set_requires_grad(true);
      const Tensor a = cross_entropy(lc, target_cpu, -100, r), b = cross_entropy(lg, target_gpu, -100, r);
      ASSERT_EQ(a.shape(), b.shape());
      EXPECT_LE(rel_error(host_f64(b), host_f64(a)), 1e-5);
      const Tensor w = rand(a.shape(), a.dtype(), kCPU, &gen);  // weights for reduction none
      backward(sum(mul(a, w)));
      backward(sum(mul(b, prim::to(w, Device("cuda:0")))));
      EXPECT_LE(rel_error(host_f64(lg.grad()), host_f64(lc.grad())), dt == DType::f32 ? 1e-5 : 1e-2);
    }
  // Many classes, a row spanning many passes of a warp in 16-byte loads
  // (1000 f32 or 50304 16-bit classes) or in single ones (1001): wide
  // logits whose exponentials overflow without the running maximum, a row
  // with -inf entries, an ignored row.
  for (DType dt : {DType::f32, DType::f16, DType::bf16})
    for (int64_t classes : {int64_t{1000}, int64_t{1001}, int64_t{50304}}) {
      SCOPED_TRACE(::testing::Message() << "seed " << seed << " " << dtype_name(dt) << " classes " << classes);
      const int64_t rows = 33;
      Tensor wide_logits = mul(randn({rows, classes}, DType::f32, kCPU, &gen), full({}, 30.0, DType::f32));
      std::vector<int64_t> ids(rows);
      for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>((i * 997 + 1) % classes);
      ids[5] = -100;
      float* x = wide_logits.data<float>();
      for (int64_t c = 0; c < classes; c += 3)
        if (c != ids[2]) x[2 * classes + c] = -INFINITY;
      Tensor lc = prim::to(wide_logits, dt).set_requires_grad(true);
      Tensor lg = prim::to(lc, Device("cuda:0")).set_requires_grad(true);
      const Tensor tc = from_vector(ids, {rows}, DType::i64);
      const Tensor a = cross_entropy(lc, tc), b = cross_entropy(lg, prim::to(tc, Device("cuda:0")));
      EXPECT_NEAR(a.item(), b.item(), 1e-5 * std::abs(a.item()));
      backward(a);
      backward(b);
      EXPECT_LE(rel_error(host_f64(lg.grad()), host_f64(lc.grad())), dt == DType::f32 ? 1e-5 : 1e-2);
    }
}

// A NaN logit makes its row's loss NaN, as on the CPU and in PyTorch, also
// where it is the only value a lane of the row's warp reads (10 classes:
// one a lane) and beside -inf values.
TEST(CudaAutograd, CrossEntropyCarriesANanLogitIntoTheLoss) {
  MPT_SKIP_WITHOUT_CUDA();
  for (DType dt : {DType::f32, DType::bf16})
    for (int64_t classes : {int64_t{10}, int64_t{1000}}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " classes " << classes);
      std::vector<float> x(static_cast<size_t>(2 * classes), 0.5f);
      x[static_cast<size_t>(classes + 7)] = std::nanf("");
      for (int64_t c = 39; c < classes; c += 32) x[static_cast<size_t>(classes + c)] = -INFINITY;
      const Tensor logits = prim::to(from_vector(x, {2, classes}), dt);
      const Tensor target = from_vector(std::vector<int64_t>{1, 2}, {2}, DType::i64);
      const std::vector<double> cpu = host_f64(cross_entropy(logits, target, -100, Reduction::none));
      const std::vector<double> gpu = host_f64(cross_entropy(prim::to(logits, Device("cuda:0")),
                                                             prim::to(target, Device("cuda:0")), -100, Reduction::none));
      EXPECT_FALSE(std::isnan(cpu[0]));
      EXPECT_NEAR(gpu[0], cpu[0], 1e-5);
      EXPECT_TRUE(std::isnan(cpu[1]));
      EXPECT_TRUE(std::isnan(gpu[1]));
    }
}

// The fused f16/bf16 attention kernels against the composed math in f32 on
// the CPU, for the head sizes they take, lengths that are not multiples of
// their 64-row tiles, with and without the causal mask, with the default
// scale and others (a negative one takes the forward's other path).
TEST(CudaAutograd, FusedAttentionMatchesTheCpu) {
  MPT_SKIP_WITHOUT_CUDA();
  struct Geometry {
    int64_t b, h, t, d;
    bool causal;
    std::optional<double> scale;
  };
  const Geometry geometries[] = {{2, 3, 100, 64, true, {}},  {1, 2, 130, 32, false, {}}, {2, 1, 64, 128, true, {}},
                                 {1, 1, 7, 64, true, {}},    {3, 6, 256, 64, true, {}},  {2, 2, 90, 64, true, 0.3},
                                 {1, 2, 70, 32, false, -0.2}};
  for (DType dt : {DType::f16, DType::bf16})
    for (const Geometry& g : geometries) {
      const uint64_t seed = testing::fresh_seed();
      SCOPED_TRACE(::testing::Message() << "seed " << seed << " " << dtype_name(dt) << " [" << g.b << ", " << g.h
                                        << ", " << g.t << ", " << g.d << "] causal " << g.causal << " scale "
                                        << g.scale.value_or(0.0));
      Generator gen(seed);
      std::vector<Tensor> cpu, gpu;
      for (int i = 0; i < 3; ++i) {
        const Tensor x = randn({g.b, g.h, g.t, g.d}, dt, kCPU, &gen);
        cpu.push_back(prim::to(x, DType::f32).set_requires_grad(true));
        gpu.push_back(prim::to(x, Device("cuda:0")).set_requires_grad(true));
      }
      ASSERT_TRUE(prim::fused_attention_available(gpu[0], gpu[1], gpu[2]));
      const Tensor oc = scaled_dot_product_attention(cpu[0], cpu[1], cpu[2], g.causal, g.scale);
      const Tensor og = scaled_dot_product_attention(gpu[0], gpu[1], gpu[2], g.causal, g.scale);
      ASSERT_EQ(og.dtype(), dt);
      const double tol = dt == DType::f16 ? 5e-3 : 3e-2;
      EXPECT_LE(rel_error(host_f64(og), host_f64(oc)), tol) << "forward";
      const Tensor w = randn(oc.shape(), dt, kCPU, &gen);
      backward(sum(mul(oc, prim::to(w, DType::f32))));
      backward(sum(mul(og, prim::to(w, Device("cuda:0")))));
      for (int i = 0; i < 3; ++i)
        EXPECT_LE(rel_error(host_f64(gpu[i].grad()), host_f64(cpu[i].grad())), 2 * tol) << "gradient of input " << i;
    }
}

// q, k and v read where one [B, T, 3C] projection left them (strided views,
// as CausalSelfAttention cuts them), the output laid out [B, T, H, D] so the
// heads join without a copy; values and the projection's gradient against
// the composed math in f32 on the CPU.
// The unfused path (a head size the fused kernel does not take) in 16 bits
// past 256 positions: no query sees the key after it.
TEST(CudaAutograd, SixteenBitCausalAttentionNeverSeesTheNextKey) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  const Device gpu("cuda:0");
  for (DType dt : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor q = randn({1, 2, 300, 8}, dt, gpu, &gen), k = randn({1, 2, 300, 8}, dt, gpu, &gen);
    const Tensor v = randn({1, 2, 300, 8}, dt, gpu, &gen);
    ASSERT_FALSE(prim::fused_attention_available(q, k, v));
    const Tensor changed = prim::clone(v);
    prim::fill_(prim::slice(changed, 2, 257, 258), 100.0);
    const Tensor before = scaled_dot_product_attention(q, k, v, true);
    const Tensor after = scaled_dot_product_attention(q, k, changed, true);
    EXPECT_EQ(host_f64(prim::slice(before, 2, 0, 257)), host_f64(prim::slice(after, 2, 0, 257)));
  }
}

TEST(CudaAutograd, FusedAttentionReadsAFusedProjectionInPlace) {
  MPT_SKIP_WITHOUT_CUDA();
  const int64_t B = 2, T = 77, H = 3, D = 64, C = H * D;
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  const Tensor x16 = randn({B, T, 3 * C}, DType::f16, kCPU, &gen);
  const Tensor w16 = randn({B, T, C}, DType::f16, kCPU, &gen);
  auto run = [&](const Tensor& x) {
    std::vector<Tensor> parts = split(x, C, 2);
    for (Tensor& t : parts) t = transpose(reshape(t, {B, T, H, D}), 1, 2);
    const Tensor y = scaled_dot_product_attention(parts[0], parts[1], parts[2], true);
    return reshape(transpose(y, 1, 2), {B, T, C});
  };
  const Tensor xc = prim::to(x16, DType::f32).set_requires_grad(true);
  const Tensor xg = prim::to(x16, Device("cuda:0")).set_requires_grad(true);
  const Tensor yc = run(xc), yg = run(xg);
  EXPECT_TRUE(yg.is_contiguous()) << "the heads were joined by a copy";
  EXPECT_LE(rel_error(host_f64(yg), host_f64(yc)), 5e-3);
  backward(sum(mul(yc, prim::to(w16, DType::f32))));
  backward(sum(mul(yg, prim::to(w16, Device("cuda:0")))));
  EXPECT_LE(rel_error(host_f64(xg.grad()), host_f64(xc.grad())), 1e-2);
}

// Forward on a side stream: the backward rules run on that stream even when
// backward() is called outside it.
TEST(CudaAutograd, BackwardRunsOnTheForwardStream) {
  MPT_SKIP_WITHOUT_CUDA();
  const Device gpu("cuda:0");
  const Stream side = Stream::create(gpu);
  Tensor x = randn({64, 64}, DType::f32, gpu).set_requires_grad(true);
  Event x_made(gpu);  // the side stream reads x: it must wait for its making
  x_made.record();
  x_made.wait(side);
  Stream seen_by_rule;
  Tensor loss;
  {
    StreamGuard guard(side);
    Tensor y = prim::mul_scalar(x, 3.0);
    record("probe", y, {x}, [&seen_by_rule, gpu](const Grads& g) {
      seen_by_rule = current_stream(gpu);
      return Grads{prim::mul_scalar(g[0], 3.0)};
    });
    loss = sum(tanh(y));
  }
  ASSERT_FALSE(current_stream(gpu) == side);
  backward(loss);
  EXPECT_TRUE(seen_by_rule == side);
  EXPECT_FALSE(current_stream(gpu) == side);  // restored afterwards
  const Tensor expected = prim::mul_scalar(prim::sub(full({}, 1.0, DType::f32, gpu),
                                                     prim::unary(UnaryOp::square, prim::unary(UnaryOp::tanh, prim::mul_scalar(x, 3.0)))),
                                           3.0);
  EXPECT_LE(rel_error(host_f64(x.grad()), host_f64(expected)), 1e-5);
}

// The gradient of the root is made on the caller's stream, behind other
// work there; the first rule, on the forward's stream, must wait for it
// (a given gradient and the implicit 1 of a scalar alike).
TEST(CudaAutograd, BackwardOnTheForwardStreamWaitsForTheRootsGradient) {
  MPT_SKIP_WITHOUT_CUDA();
  const Device gpu("cuda:0");
  const Stream side = Stream::create(gpu);
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  for (const bool given : {true, false}) {
    SCOPED_TRACE(given ? "gradient given" : "implicit gradient");
    Tensor x = randn({256, 256}, DType::f32, gpu, &gen).set_requires_grad(true);
    Event x_made(gpu);
    x_made.record();
    x_made.wait(side);
    Tensor loss;
    {
      StreamGuard guard(side);
      loss = sum(mul(x, x));
    }
    Event loss_made(gpu);  // the caller reads loss below
    loss_made.record(side);
    loss_made.wait(current_stream(gpu));
    testing::busy_gpu(gpu);  // ahead of the gradient on the caller's stream
    const double dloss = given ? 3.0 : 1.0;
    if (given)
      backward(loss, full({}, dloss, DType::f32, gpu));
    else
      backward(loss);
    const Tensor expected = prim::mul_scalar(detach(x), 2.0 * dloss);
    EXPECT_LE(rel_error(host_f64(x.grad()), host_f64(expected)), 1e-6);
  }
}

TEST(CudaAutograd, EmbeddingMatchesTheCpuWithRepeatedIndices) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  std::mt19937_64 rng(seed);
  std::vector<int64_t> ids(3 * 57);
  for (int64_t& i : ids) i = static_cast<int64_t>(rng() % 11);  // 11 rows: many repeats
  const Tensor idx_cpu = from_vector(ids, {3, 57}, DType::i64);
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor wc = randn({11, 40}, dt, kCPU, &gen);
    Tensor wg = prim::to(wc, Device("cuda:0"));
    wc.set_requires_grad(true);
    wg.set_requires_grad(true);
    const Tensor oc = embedding(wc, idx_cpu), og = embedding(wg, prim::to(idx_cpu, Device("cuda:0")));
    EXPECT_EQ(host_f64(og), host_f64(oc));  // a gather is exact
    const Tensor w = randn(oc.shape(), dt, kCPU, &gen);
    backward(sum(mul(oc, w)));
    backward(sum(mul(og, prim::to(w, Device("cuda:0")))));
    // The GPU adds each row's terms in chunks of its sorted indices, the CPU one by one: equal up to rounding.
    EXPECT_LE(rel_error(host_f64(wg.grad()), host_f64(wc.grad())), dt == DType::f32 ? 1e-5 : 2e-2);
  }
}

// Weight gradients made beside the chain of input gradients (beside.h) are
// the same bits as made in order: the same kernels, with the side stream
// ordered after what it reads and the chain's tensors held until then. The
// GEMMs are large enough that a missing wait or an early reuse of a chain
// tensor would show. Covers sinks staying beside (a first pass, then a
// second adding into .grad), a sink with a hook (which waits instead), and
// a weight with gradients made beside and on the chain.
TEST(CudaAutograd, WeightGradientsBesideTheChainMatchTheOrderedOnes) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const Device gpu("cuda:0");
  Generator gen(seed);
  const Tensor x = randn({8192, 512}, DType::f32, gpu, &gen);
  const Tensor out_weight = randn({8192, 512}, DType::f32, gpu, &gen);
  std::vector<Tensor> init;  // 512 -> 1024 -> 1024 -> 512 -> 512
  for (auto [out, in] : {std::pair{1024, 512}, {1024, 1024}, {512, 1024}, {512, 512}})
    init.push_back(prim::mul_scalar(randn({out, in}, DType::f32, gpu, &gen), 0.04));
  auto run = [&](bool overlap) {
    beside::set_enabled(overlap);
    std::vector<Tensor> w;
    for (const Tensor& t : init) w.push_back(prim::clone(t).set_requires_grad(true));
    double hook_sum = 0.0;
    w.back().autograd_meta().post_accumulate_hooks.push_back(
        [&hook_sum](const Tensor& leaf) { hook_sum += prim::sum(leaf.grad()).item(); });
    for (int pass = 0; pass < 2; ++pass) {
      Tensor h = x;
      {
        amp::AutocastGuard autocast(DeviceType::cuda, DType::f16);
        for (const Tensor& t : w) h = gelu(linear(h, t, Tensor()));
        h = linear(h, w.back(), Tensor());  // its cast's two gradients, both made beside, are summed there
      }
      // A third gradient of the last weight, from the chain: summed with the
      // others after the chain waits for the side stream.
      backward(add(sum(mul(to(h, DType::f32), out_weight)), sum(w.back())));
    }
    beside::set_enabled(true);
    std::vector<std::vector<double>> grads;
    for (const Tensor& t : w) grads.push_back(host_f64(t.grad()));
    return std::make_pair(grads, hook_sum);
  };
  const auto [ordered, ordered_hook] = run(false);
  const auto [overlapped, overlapped_hook] = run(true);
  for (size_t i = 0; i < ordered.size(); ++i) EXPECT_EQ(overlapped[i], ordered[i]) << "weight " << i;
  EXPECT_EQ(overlapped_hook, ordered_hook);
}

// Backward frees as it goes: each node's incoming gradients and saved
// tensors are released once its rule has run, so the memory held during
// backward stays near what forward left, instead of growing by every
// layer's gradients.
TEST(CudaAutograd, BackwardFreesGradientsAndSavedTensorsAsItGoes) {
  MPT_SKIP_WITHOUT_CUDA();
  const Device gpu("cuda:0");
  constexpr int kLayers = 8;
  constexpr int64_t kRows = 4096, kWidth = 1024;  // one activation: 16 MiB in f32
  Generator gen(11);
  std::vector<Tensor> weights;
  for (int i = 0; i < kLayers; ++i)
    weights.push_back(prim::to(mul(randn({kWidth, kWidth}, DType::f32, kCPU, &gen), 0.03), gpu).set_requires_grad(true));
  Tensor h = randn({kRows, kWidth}, DType::f32, gpu, &gen);
  for (const Tensor& w : weights) h = relu(linear(h, w, Tensor()));
  const Tensor loss = sum(h);
  h = Tensor();
  const double activation = kRows * kWidth * 4.0, weight = kWidth * kWidth * 4.0;
  const MemoryStats after_forward = memory_stats(gpu);
  reset_peak_memory_stats(gpu);
  std::vector<double> held;
  set_backward_observer([&](const std::string&) { held.push_back(static_cast<double>(memory_stats(gpu).allocated_bytes)); });
  backward(loss);
  set_backward_observer(nullptr);
  const double growth = static_cast<double>(memory_stats(gpu).peak_allocated_bytes) -
                        static_cast<double>(after_forward.allocated_bytes);
  // A few activation-sized gradients in flight (with the inputs of the two
  // weight gradients that may run beside the chain at once) and the weight
  // gradients made so far; piling up every layer's gradients would add
  // about kLayers * 2 activations.
  EXPECT_LT(growth, 4 * activation + kLayers * 2 * weight) << "grew by " << growth / 1048576 << " MiB";
  // And memory falls as layers finish; once the pass is over (the weight
  // gradients made beside the chain complete, the chain tensors they read
  // let go), less is held than after forward.
  ASSERT_FALSE(held.empty());
  EXPECT_LT(held.back(), held.front());
  EXPECT_LT(static_cast<double>(memory_stats(gpu).allocated_bytes),
            static_cast<double>(after_forward.allocated_bytes) - kLayers / 2 * activation);
}

// The fused kernels' rules check what they saved as the CPU's do: writing
// attention's query or its output (which its backward reads), or the
// class indices cross-entropy read, before backward is refused.
TEST(CudaAutograd, FusedRulesRefuseSavedTensorsWrittenSinceForward) {
  MPT_SKIP_WITHOUT_CUDA();
  const Device gpu{DeviceType::cuda, 0};
  Generator gen(testing::fresh_seed());
  auto expect_refused = [](const Tensor& loss, const char* op) {
    try {
      backward(loss);
      ADD_FAILURE() << op << ": backward ran on a saved tensor written after forward";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(op), std::string::npos) << e.what();
    }
  };
  for (int written : {0, 1}) {
    Tensor q = randn({1, 2, 64, 32}, DType::f16, gpu, &gen).set_requires_grad(true);
    const Tensor kv = randn({1, 2, 64, 32}, DType::f16, gpu, &gen);
    const Tensor out = scaled_dot_product_attention(q, kv, kv, true);
    const Tensor loss = sum(to(out, DType::f32));
    prim::fill_(written == 0 ? q : out, 0.5);
    expect_refused(loss, "'scaled_dot_product_attention'");
  }
  Tensor logits = randn({8, 100}, DType::f16, gpu, &gen).set_requires_grad(true);
  const Tensor target = prim::to(from_vector<int64_t>({1, 2, 3, 4, 5, 6, 7, 8}, {8}, DType::i64), gpu);
  const Tensor loss = cross_entropy(logits, target);
  prim::fill_(target, 0.0);
  expect_refused(loss, "'cross_entropy'");
}

}  // namespace
}  // namespace mpt
