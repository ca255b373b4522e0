// The fused unscale + inf check on the CPU against its written rule:
// g[i] = round_T(f32(g[i]) * inv_scale); found_inf = 1 iff some f32(g[i])
// is inf or NaN; found_inf is never cleared.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "amp/unscale.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

template <typename T>
std::vector<float> rounded(const std::vector<float>& v) {
  std::vector<float> out;
  for (float f : v) out.push_back(static_cast<float>(T(f)));
  return out;
}

std::vector<float> round_to(DType dtype, const std::vector<float>& v) {
  if (dtype == DType::f16) return rounded<Half>(v);
  if (dtype == DType::bf16) return rounded<BFloat16>(v);
  return v;
}

bool same_bits(float a, float b) { return std::isnan(a) ? std::isnan(b) : a == b; }

TEST(Unscale, CpuFollowsTheRuleForEveryGradientDtype) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  Generator gen(seed);
  for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    for (bool poison : {false, true}) {
      SCOPED_TRACE(fmt::format("{} poison {}", dtype_name(dtype), poison));
      std::vector<Tensor> grads;
      std::vector<std::vector<float>> before;
      for (int64_t n : {1, 5, 64, 1001}) {
        Tensor g = prim::to(prim::mul_scalar(randn({n}, DType::f32, kCPU, &gen), 3000.0), dtype);
        grads.push_back(g);
      }
      if (poison) prim::fill_(prim::slice(grads[2], 0, 17, 18), std::numeric_limits<double>::quiet_NaN());
      for (const Tensor& g : grads) before.push_back(g.to_vector<float>());
      Tensor found = zeros({1});
      const float inv = 1.0f / 3000.0f;
      amp::unscale_and_check_inf_(grads, found, full({1}, inv));
      EXPECT_EQ(found.item(), poison ? 1.0 : 0.0);
      for (size_t t = 0; t < grads.size(); ++t) {
        std::vector<float> expected;
        for (float v : before[t]) expected.push_back(v * inv);
        expected = round_to(dtype, expected);
        const auto got = grads[t].to_vector<float>();
        for (size_t i = 0; i < got.size(); ++i) ASSERT_TRUE(same_bits(got[i], expected[i])) << t << "," << i;
      }
    }
  }
}

TEST(Unscale, FoundInfAccumulatesAcrossCalls) {
  Tensor found = zeros({1});
  std::vector<Tensor> bad{full({3}, std::numeric_limits<double>::infinity())};
  std::vector<Tensor> good{full({3}, 2.0)};
  amp::unscale_and_check_inf_(bad, found, full({1}, 0.5));
  amp::unscale_and_check_inf_(good, found, full({1}, 0.5));
  EXPECT_EQ(found.item(), 1.0);
  EXPECT_EQ(good[0].to_vector<float>(), std::vector<float>(3, 1.0f));
}

// The check alone: the same verdict, the gradients untouched.
TEST(Unscale, CheckInfFindsWhatUnscaleFindsAndWritesNothing) {
  for (DType dtype : {DType::f32, DType::f16, DType::bf16})
    for (const bool poison : {false, true}) {
      SCOPED_TRACE(fmt::format("{} poison {}", dtype_name(dtype), poison));
      std::vector<Tensor> grads{prim::to(full({7}, 3.0), dtype), prim::to(full({1001}, -5.0), dtype)};
      if (poison) prim::fill_(prim::slice(grads[1], 0, 500, 501), -std::numeric_limits<double>::infinity());
      const auto before = grads[1].to_vector<float>();
      Tensor found = zeros({1});
      amp::check_inf_(grads, found);
      EXPECT_EQ(found.item(), poison ? 1.0 : 0.0);
      EXPECT_EQ(grads[0].to_vector<float>(), std::vector<float>(7, 3.0f));
      const auto after = grads[1].to_vector<float>();
      for (size_t i = 0; i < after.size(); ++i) ASSERT_TRUE(same_bits(after[i], before[i])) << i;
    }
  Tensor found_i32 = zeros({1}, DType::i32);
  EXPECT_THROW(amp::check_inf_({full({2}, 1.0)}, found_i32), ValueError);
}

TEST(Unscale, RejectsBadOperandsBeforeTouchingAnything) {
  Tensor found = zeros({1});
  const Tensor inv = full({1}, 0.5);
  Tensor ok = full({4}, 2.0);
  std::vector<Tensor> with_int{ok, zeros({2}, DType::i32)};
  EXPECT_THROW(amp::unscale_and_check_inf_(with_int, found, inv), DTypeError);
  EXPECT_EQ(ok.to_vector<float>(), std::vector<float>(4, 2.0f));  // the good gradient before it is untouched
  std::vector<Tensor> strided{ok, prim::transpose(zeros({2, 3}), 0, 1)};
  EXPECT_THROW(amp::unscale_and_check_inf_(strided, found, inv), ValueError);
  std::vector<Tensor> other_device{ok, zeros({2}, DType::f32, Device(DeviceType::cpu, 1))};
  EXPECT_THROW(amp::unscale_and_check_inf_(other_device, found, inv), DeviceError);
  Tensor found_i32 = zeros({1}, DType::i32);
  std::vector<Tensor> one{ok};
  EXPECT_THROW(amp::unscale_and_check_inf_(one, found_i32, inv), ValueError);
  EXPECT_EQ(ok.to_vector<float>(), std::vector<float>(4, 2.0f));
}

}  // namespace
}  // namespace mpt
