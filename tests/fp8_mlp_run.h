#pragma once
// A few training steps of a transformer's MLP in FP8, out(gelu(fc(x))), as
// amp::fp8_mlp or as the three ops (fp8_linear, gelu, fp8_linear), with
// everything they produce kept as bytes, and the check that the two runs
// agree bit for bit (on the CPU and on the GPU).
#include <gtest/gtest.h>

#include <initializer_list>
#include <memory>
#include <random>
#include <vector>

#include "amp/fp8_linear.h"
#include "amp/fp8_scaling.h"
#include "autograd/engine.h"
#include "autograd/ops.h"
#include "tests/fp8_test_values.h"

namespace mpt::testing {

struct Fp8MlpShape {
  int64_t rows, in, hidden, out;
};

// Per step: the output, the gradients of x, fc's weight and bias, out's
// weight and bias, then (after the scaling's update) every scaling state
// tensor, each as its bytes.
inline std::vector<std::vector<uint8_t>> fp8_mlp_run(const Device& device, bool fused, const amp::Fp8Recipe& recipe,
                                                     GeluApprox approx, const Fp8MlpShape& shape, uint64_t seed,
                                                     int steps) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto randoms = [&](const Shape& s, float scale, DType dtype) {
    std::vector<float> v(static_cast<size_t>(numel(s)));
    for (auto& e : v) e = normal(rng) * scale;
    return prim::to(prim::to(from_vector(v, s), dtype), device);
  };
  const auto [rows, in, hidden, out] = shape;
  const Tensor w1 = randoms({hidden, in}, 0.1f, DType::f32), b1 = randoms({hidden}, 0.5f, DType::f32);
  const Tensor w2 = randoms({out, hidden}, 0.05f, DType::f32), b2 = randoms({out}, 0.1f, DType::f32);
  auto scaling = std::make_shared<amp::Fp8Scaling>(recipe, device);
  amp::Fp8LinearState fc = amp::Fp8LinearState::for_layer(scaling, "fc");
  amp::Fp8LinearState proj = amp::Fp8LinearState::for_layer(scaling, "out");
  std::vector<std::vector<uint8_t>> kept;
  for (int step = 0; step < steps; ++step) {
    // Fresh leaves each step (the weights' copies are made again, with
    // the step's scales); inputs of the scales of a layer norm's output.
    auto leaf = [](const Tensor& t) { return prim::clone(t).set_requires_grad(true); };
    Tensor x = leaf(randoms({2, rows / 2, in}, 1.5f, DType::bf16));
    Tensor v1 = leaf(w1), c1 = leaf(b1), v2 = leaf(w2), c2 = leaf(b2);
    const Tensor y = fused ? amp::fp8_mlp(x, {v1, c1, &fc}, {v2, c2, &proj}, approx)
                           : amp::fp8_linear(gelu(amp::fp8_linear(x, v1, c1, fc), approx), v2, c2, proj);
    const Tensor g = randoms({2, rows / 2, out}, 1e-3f, DType::f32);
    backward(sum(mul(to(y, DType::f32), g)));
    for (const Tensor& t : {y, x.grad(), v1.grad(), c1.grad(), v2.grad(), c2.grad()}) kept.push_back(bytes_of(t));
    scaling->update();
    for (const auto& [name, t] : scaling->state()) kept.push_back(bytes_of(t));
  }
  return kept;
}

// fp8_mlp against the three ops on `device`, bit for bit, over 3 steps of
// each recipe (delayed: each step's scales from the last one's amaxes),
// both GELU forms and each shape.
inline void expect_fp8_mlp_is_the_ops(const Device& device, std::initializer_list<Fp8MlpShape> shapes,
                                      uint64_t seed) {
  for (amp::Fp8ScalingMode mode : {amp::Fp8ScalingMode::delayed, amp::Fp8ScalingMode::current})
    for (GeluApprox approx : {GeluApprox::none, GeluApprox::tanh})
      for (const Fp8MlpShape& shape : shapes) {
        SCOPED_TRACE(fmt::format("{} {} rows {}", amp::fp8_scaling_mode_name(mode),
                                 approx == GeluApprox::none ? "erf" : "tanh", shape.rows));
        amp::Fp8Recipe recipe;
        recipe.scaling = mode;
        recipe.history_length = 4;
        const auto fused = fp8_mlp_run(device, true, recipe, approx, shape, seed, 3);
        const auto composed = fp8_mlp_run(device, false, recipe, approx, shape, seed, 3);
        ASSERT_EQ(fused.size(), composed.size());
        for (size_t i = 0; i < fused.size(); ++i) EXPECT_EQ(fused[i], composed[i]) << "entry " << i;
      }
}

}  // namespace mpt::testing
