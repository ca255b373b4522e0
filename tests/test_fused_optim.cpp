// The fused optimizer updates (models/fused_optim.h): the host loops, which
// are the CPU's default path, against the raw-op rules; and the fused AdamW
// on every device against its written rule, bit for bit. This file is built
// without floating-point contraction, so the rule replayed here rounds each
// multiply and add where it is written.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>

#include "models/adamw.h"
#include "models/sgd.h"
#include "tests/optimizer_check.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

using testing::host_f64;
using testing::MakeOptimizer;
using testing::rel_error;

// The host loop in `dt` against the raw-op rule in `dt`.
void expect_host_loop_matches_raw_ops(const MakeOptimizer& make, DType dt, double tol) {
  testing::expect_update_matches_raw_ops(make, kCPU, dt, /*fused=*/true, tol);
}

TEST(HostOptim, FusedLoopsMatchTheRawOpRules) {
  const MakeOptimizer adamw = [](std::vector<Tensor> p) {
    return std::make_unique<optim::AdamW>(std::move(p), optim::AdamWOptions{1e-2, 0.9, 0.99, 1e-8, 0.1});
  };
  expect_host_loop_matches_raw_ops(adamw, DType::f32, 1e-5);
  expect_host_loop_matches_raw_ops(adamw, DType::bf16, 2e-2);
  expect_host_loop_matches_raw_ops(adamw, DType::f16, 5e-3);
  // A weight decay that makes a quarter of each update: one left out or
  // misapplied shows in 16 bits too.
  const MakeOptimizer decaying = [](std::vector<Tensor> p) {
    return std::make_unique<optim::AdamW>(std::move(p), optim::AdamWOptions{1e-2, 0.9, 0.99, 1e-8, 5.0});
  };
  expect_host_loop_matches_raw_ops(decaying, DType::bf16, 2e-2);
  expect_host_loop_matches_raw_ops(decaying, DType::f16, 5e-3);
  for (bool nesterov : {false, true}) {
    SCOPED_TRACE(nesterov ? "nesterov" : "momentum");
    const MakeOptimizer sgd = [nesterov](std::vector<Tensor> p) {
      return std::make_unique<optim::SGD>(std::move(p),
                                          optim::SGDOptions{0.05, 0.9, nesterov ? 0.0 : 0.1, 1e-3, nesterov});
    };
    expect_host_loop_matches_raw_ops(sgd, DType::f32, 1e-6);
    expect_host_loop_matches_raw_ops(sgd, DType::bf16, 2e-2);
  }
}

// The raw-op AdamW on f16 parameters computes in f32 and rounds each
// stored tensor once, as the fused loop does: gradients of a few hundred,
// whose squares f16 cannot hold, leave finite moments and a parameter that
// keeps moving.
TEST(HostOptim, RawOpAdamWOnF16SquaresGradientsBeyondF16sRange) {
  Generator gen(11);
  const Tensor start = prim::to(randn({64}, DType::f32, kCPU, &gen), DType::f16);
  Tensor a = prim::clone(start).set_requires_grad(true), b = prim::clone(start).set_requires_grad(true);
  optim::AdamW fused({a}, optim::AdamWOptions{1e-2}), raw({b}, optim::AdamWOptions{1e-2});
  raw.set_fused(false);
  for (int step = 0; step < 3; ++step) {
    const Tensor g = prim::to(prim::mul_scalar(randn({64}, DType::f32, kCPU, &gen), 300.0), DType::f16);
    a.set_grad(g);
    b.set_grad(g);
    fused.step();
    raw.step();
    if (step == 0) {
      // The first update is lr times the gradient's sign; an infinite
      // exp_avg_sq would make it 0.
      const std::vector<double> moved = host_f64(b), s = host_f64(start);
      for (size_t i = 0; i < moved.size(); ++i) EXPECT_NEAR(std::abs(moved[i] - s[i]), 1e-2, 4e-3) << i;
    }
  }
  for (double v : host_f64(raw.state(0).buffers.at("exp_avg_sq"))) ASSERT_TRUE(std::isfinite(v));
  // Both round each result once from f32, in their own order of operations.
  const std::vector<double> fa = host_f64(a), rb = host_f64(b);
  for (size_t i = 0; i < fa.size(); ++i) EXPECT_NEAR(rb[i], fa[i], 3e-3 * std::abs(fa[i]) + 1e-4) << i;
}

// f64 parameters keep the raw-op rule: the fused rules compute in f32.
TEST(HostOptim, F64ParametersKeepTheRawOpRule) {
  Generator gen(7);
  const Tensor start = randn({50}, DType::f64, kCPU, &gen);
  Tensor a = prim::clone(start).set_requires_grad(true), b = prim::clone(start).set_requires_grad(true);
  optim::AdamW fused({a}, optim::AdamWOptions{1e-2}), raw({b}, optim::AdamWOptions{1e-2});
  raw.set_fused(false);
  for (int step = 0; step < 3; ++step) {
    const Tensor g = randn({50}, DType::f64, kCPU, &gen);
    a.set_grad(g);
    b.set_grad(g);
    fused.step();
    raw.step();
  }
  EXPECT_EQ(host_f64(a), host_f64(b));
}

// The fused f32 AdamW rounds exactly as its written rule: each multiply,
// fused multiply-add, square root and division once, in the order the
// kernel and the host loop spell them. The rule is replayed here in f32
// from the same bias corrections and 1 - beta the optimizer works out in
// double; every parameter and moment must match bit for bit. An update
// whose arithmetic the compiler contracts as it pleases changes with the
// build.
void expect_adamw_rounds_as_written(const Device& device) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " on " << device.str());
  Generator gen(seed);
  const double lr = 3e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.05;
  // Large enough to be split over the CPU threads, with a ragged last piece.
  const int64_t n = 3 * 65536 + 1001;
  const Tensor start = randn({n}, DType::f32, kCPU, &gen);
  Tensor param = prim::to(start, device).set_requires_grad(true);
  optim::AdamW adamw({param}, optim::AdamWOptions{lr, beta1, beta2, eps, weight_decay});
  std::vector<float> p = start.to_vector<float>(), m(n, 0.0f), v(n, 0.0f);
  const float b1 = static_cast<float>(beta1), b2 = static_cast<float>(beta2), e = static_cast<float>(eps);
  const float one_minus_b1 = static_cast<float>(1.0 - beta1), one_minus_b2 = static_cast<float>(1.0 - beta2);
  const float decay = static_cast<float>(1.0 - lr * weight_decay);
  for (int step = 1; step <= 3; ++step) {
    const Tensor grad = prim::mul_scalar(randn({n}, DType::f32, kCPU, &gen), std::pow(10.0, step - 2));
    param.set_grad(prim::to(grad, device));
    adamw.step();
    // The bias corrections as AdamW computes them on the host, in double.
    const float step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, step)));
    const float inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(beta2, step)));
    const std::vector<float> g = grad.to_vector<float>();
    for (int64_t i = 0; i < n; ++i) {
      m[i] = std::fma(b1, m[i], one_minus_b1 * g[i]);
      v[i] = std::fma(b2, v[i], (one_minus_b2 * g[i]) * g[i]);
      const float denom = std::fma(std::sqrt(v[i]), inv_bc2_sqrt, e);
      p[i] = std::fma(p[i], decay, -((step_size * m[i]) / denom));
    }
  }
  const optim::ParamState& state = adamw.state(0);
  const std::vector<std::pair<const char*, std::pair<std::vector<float>, std::vector<float>>>> checks = {
      {"param", {param.to_vector<float>(), p}},
      {"exp_avg", {state.buffers.at("exp_avg").to_vector<float>(), m}},
      {"exp_avg_sq", {state.buffers.at("exp_avg_sq").to_vector<float>(), v}}};
  for (const auto& [name, values] : checks) {
    int64_t differ = 0, first = -1;
    for (int64_t i = 0; i < n; ++i)
      if (std::memcmp(&values.first[i], &values.second[i], sizeof(float)) != 0 && differ++ == 0) first = i;
    EXPECT_EQ(differ, 0) << name << ": " << differ << " of " << n << " differ; the first, element " << first
                         << ": " << (first >= 0 ? values.first[first] : 0.0f) << " against "
                         << (first >= 0 ? values.second[first] : 0.0f);
  }
}

TEST(HostOptim, FusedAdamWRoundsAsItsWrittenRule) { expect_adamw_rounds_as_written(kCPU); }

TEST(CudaOptim, FusedAdamWRoundsAsItsWrittenRule) {
  MPT_SKIP_WITHOUT_CUDA();
  expect_adamw_rounds_as_written(Device("cuda:0"));
}

}  // namespace
}  // namespace mpt
