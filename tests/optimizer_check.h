#pragma once
// An optimizer's update on some device (fused or not) against its raw-op
// rule on the CPU: the same parameters and gradients, several steps, many
// tensors of awkward sizes, per dtype tolerance.
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>

#include "models/optimizer.h"
#include "tests/test_util.h"

namespace mpt::testing {

using MakeOptimizer = std::function<std::unique_ptr<optim::Optimizer>(std::vector<Tensor>)>;

// 45 tensors: more than one launch's list, one larger than a chunk.
inline std::vector<Shape> awkward_shapes() {
  std::vector<Shape> shapes;
  for (int64_t i = 0; i < 42; ++i) shapes.push_back({1 + (i * 37) % 101, 1 + i % 3});
  shapes.push_back({1});
  shapes.push_back({70001});
  shapes.push_back({257, 300});
  return shapes;
}

// Four updates with the same gradients on `device` (its fused path or not)
// and with the raw-op rule on the CPU, some parameters sitting a step out,
// then every parameter and the optimizer state compared. The reference
// keeps the same dtype, so its parameters and state are rounded to it after
// every step as the tested ones are (an f32 reference drifts away from
// 16-bit state: an exp_avg_sq of a gradient near 1e-3 underflows f16 and
// the next update divides by eps alone). 16-bit parameters are drawn small
// (one update is then many ulps of them), and what they moved is compared
// as well as where they ended: an update a 16-bit path got wrong by a few
// percent would hide in the values themselves.
inline void expect_update_matches_raw_ops(const MakeOptimizer& make, const Device& device, DType dt, bool fused,
                                          double tol) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " dtype " << dtype_name(dt) << " on " << device.str()
                                    << " fused " << fused);
  Generator gen(seed);
  const bool sixteen_bits = dt == DType::f16 || dt == DType::bf16;
  std::vector<Tensor> ref, tested;
  std::vector<double> start;
  for (const Shape& s : awkward_shapes()) {
    const Tensor p = sixteen_bits ? prim::to(prim::mul_scalar(randn(s, DType::f32, kCPU, &gen), 0.05), dt)
                                  : randn(s, dt, kCPU, &gen);
    const std::vector<double> values = host_f64(p);
    start.insert(start.end(), values.begin(), values.end());
    // Copies: a conversion to the same device and dtype would share p.
    ref.push_back(prim::clone(p).set_requires_grad(true));
    tested.push_back(prim::clone(prim::to(p, device)).set_requires_grad(true));
  }
  auto opt_ref = make(ref), opt_tested = make(tested);
  opt_ref->set_fused(false);  // the reference: the rule written with raw ops
  opt_tested->set_fused(fused);
  for (int step = 0; step < 4; ++step) {
    for (size_t i = 0; i < ref.size(); ++i) {
      if (step == 2 && i % 5 == 0) {  // some parameters sit a step out
        ref[i].set_grad(Tensor());
        tested[i].set_grad(Tensor());
        continue;
      }
      const Tensor g = randn(ref[i].shape(), dt, kCPU, &gen);
      ref[i].set_grad(g);
      tested[i].set_grad(prim::clone(prim::to(g, device)));
    }
    opt_ref->step();
    opt_tested->step();
  }
  // Error over all tensors together: a one-element state can cancel to
  // nearly zero, where a per-tensor relative error means nothing in 16 bits.
  std::vector<double> got, want;
  auto append = [](std::vector<double>& to, const Tensor& t) {
    const std::vector<double> v = host_f64(t);
    to.insert(to.end(), v.begin(), v.end());
  };
  // One tensor in f32: relative to its own size, or to 1 (the size of the
  // gradients) where its values cancel to nearly zero (a one-element
  // momentum, say) and rounding alone makes the relative error large.
  auto expect_tensor_close = [tol](const Tensor& g, const Tensor& c, const std::string& what) {
    const std::vector<double> gv = host_f64(g), cv = host_f64(c);
    EXPECT_TRUE(rel_error(gv, cv) <= tol || max_abs_diff(gv, cv) <= tol)
        << what << ": relative error " << rel_error(gv, cv) << ", largest difference " << max_abs_diff(gv, cv);
  };
  for (size_t i = 0; i < ref.size(); ++i) {
    append(got, tested[i]);
    append(want, ref[i]);
    if (dt == DType::f32) expect_tensor_close(tested[i], ref[i], "parameter " + std::to_string(i));
  }
  EXPECT_LE(rel_error(got, want), tol) << "parameters";
  if (sixteen_bits) {
    for (size_t i = 0; i < start.size(); ++i) {
      got[i] -= start[i];
      want[i] -= start[i];
    }
    EXPECT_LE(rel_error(got, want), tol) << "parameter updates";
  }
  // The state carries over: the tested buffers equal the reference's too.
  const auto state_ref = opt_ref->state_dict(), state_tested = opt_tested->state_dict();
  ASSERT_EQ(state_ref.size(), state_tested.size());
  got.clear();
  want.clear();
  for (const auto& [key, t] : state_ref) {
    ASSERT_TRUE(state_tested.contains(key)) << key;
    append(got, state_tested.at(key));
    append(want, t);
    if (dt == DType::f32) expect_tensor_close(state_tested.at(key), t, key);
  }
  EXPECT_LE(rel_error(got, want), tol) << "optimizer state";
}

}  // namespace mpt::testing
