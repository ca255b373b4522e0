// tensor/cpu/fast_math.h's exp and GELU's 1 + erf against libm in f64, and
// the CPU's GELU forward and backward (which use them in f32) against the
// f64 formulas.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <vector>

#include "tensor/cpu/fast_math.h"
#include "tensor/ops.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

// f32 units in the last place of `exact` (a normal f32 value).
double ulp_of(double exact) {
  const float f = static_cast<float>(exact);
  return std::nextafter(std::fabs(f), INFINITY) - std::fabs(f);
}

TEST(CpuFastExp, WithinTwoUlpOfTheExactValue) {
  // 2^20 points spread over [-104, 89] (their low bits vary), values near
  // 0 of every binade, and the edges.
  std::vector<float> xs{0.0f, -0.0f, 1.0f, -1.0f, 88.7f, 88.72f, -87.3f, -103.0f, -103.97f};
  const int n = 1 << 20;
  for (int i = 0; i <= n; ++i) xs.push_back(static_cast<float>(-104.0 + 193.0 * i / n));
  for (int e = -149; e < 0; ++e) {
    xs.push_back(std::ldexp(1.0f, e));
    xs.push_back(-std::ldexp(1.3f, e));
  }
  int checked = 0;
  for (float x : xs) {
    const double exact = std::exp(static_cast<double>(x));
    const float got = cpu::exp_f32(x);
    if (exact < std::numeric_limits<float>::min()) {  // subnormal or zero: an absolute bound
      EXPECT_LE(std::abs(got - exact), 2 * std::numeric_limits<float>::denorm_min()) << x;
    } else if (exact > std::numeric_limits<float>::max()) {
      EXPECT_EQ(got, std::numeric_limits<float>::infinity()) << x;
    } else {
      EXPECT_LE(std::abs(got - exact), 2 * ulp_of(exact)) << "x " << x << " exact " << exact << " got " << got;
    }
    ++checked;
  }
  EXPECT_GT(checked, 1000);
  EXPECT_EQ(cpu::exp_f32(-INFINITY), 0.0f);
  EXPECT_EQ(cpu::exp_f32(INFINITY), INFINITY);
  EXPECT_EQ(cpu::exp_f32(-200.0f), 0.0f);
  EXPECT_TRUE(std::isnan(cpu::exp_f32(std::numeric_limits<float>::quiet_NaN())));
}

TEST(CpuFastErf, OnePlusErfWithinAFewUlpEverywhere) {
  // Relative error of 1 + erf(u), also far out on the negative side where
  // it is erfc(-u) and tiny.
  double worst = 0;
  const int n = 1 << 18;
  for (int i = 0; i <= n; ++i) {
    const float u = static_cast<float>(-9.0 + 18.0 * i / n);
    const double exact = std::erfc(-static_cast<double>(u));  // 1 + erf(u)
    if (exact < std::numeric_limits<float>::min()) continue;
    const double err = std::fabs(cpu::one_plus_erf_f32(u) - exact) / ulp_of(exact);
    worst = std::max(worst, err);
  }
  // Numerical Recipes' fit is good to 1.2e-7 of erfc (2 ulp), the two exps
  // add 2 ulp each, and the products and P's sum a few roundings.
  EXPECT_LE(worst, 8.0);
  std::printf("1 + erf: worst %.2f ulp\n", worst);
  EXPECT_EQ(cpu::one_plus_erf_f32(INFINITY), 2.0f);
  EXPECT_EQ(cpu::one_plus_erf_f32(-INFINITY), 0.0f);
  EXPECT_TRUE(std::isnan(cpu::one_plus_erf_f32(std::numeric_limits<float>::quiet_NaN())));
}

TEST(CpuFastErf, GeluAndItsGradientMatchTheF64Formulas) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  // Large enough that the work splits over the backend's threads.
  const Tensor x = prim::mul_scalar(randn({300, 1000}, DType::f32, kCPU, &gen), 3.0);
  const Tensor g = randn({300, 1000}, DType::f32, kCPU, &gen);
  const auto y = testing::host_f64(prim::unary(UnaryOp::gelu_erf, x));
  const auto gx = testing::host_f64(prim::binary(BinaryOp::gelu_erf_backward, g, x));
  const auto xv = testing::host_f64(x), gv = testing::host_f64(g);
  for (size_t i = 0; i < xv.size(); ++i) {
    const double u = xv[i] / std::sqrt(2.0);
    const double ref = 0.5 * xv[i] * std::erfc(-u);
    const double ref_grad = gv[i] * (0.5 * std::erfc(-u) + xv[i] * std::exp(-0.5 * xv[i] * xv[i]) / std::sqrt(2 * M_PI));
    // x / sqrt 2 rounds to f32 (2^-24 of itself), and 1 + erf(u) for u < 0
    // moves by 2|u| of itself per unit of relative change in u: the
    // condition of the problem, which libm's erff has too.
    const double rounding_of_u = 2 * u * u * std::ldexp(1.0, -24);
    ASSERT_NEAR(y[i], ref, (1e-6 + 2 * rounding_of_u) * std::fabs(ref) + 1e-30) << "x " << xv[i];
    ASSERT_NEAR(gx[i], ref_grad, 1e-6 * std::fabs(gv[i]) + 1e-30) << "x " << xv[i];
  }
}

}  // namespace
}  // namespace mpt
