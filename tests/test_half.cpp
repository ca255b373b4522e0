// f16 / bf16 conversions against an independent reference: the nearest
// representable value by search over all 65536 encodings, ties to even,
// overflow at max + half an ulp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "tensor/half.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

struct Format {
  float (*to_float)(uint16_t);
  uint16_t inf_bits;
};

// Reference rounding of a finite double x to the format's encoding.
uint16_t reference_round(double x, const Format& f) {
  static std::map<uint16_t, std::vector<std::pair<double, uint16_t>>> cache;
  auto& table = cache[f.inf_bits];
  if (table.empty()) {
    for (uint32_t b = 0; b < 0x10000; ++b) {
      const float v = f.to_float(static_cast<uint16_t>(b));
      if (std::isfinite(v) && !(b & 0x8000)) table.emplace_back(v, static_cast<uint16_t>(b));
    }
    std::sort(table.begin(), table.end());
  }
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(x);
  const double max = table.back().first;
  const double ulp_at_max = max - table[table.size() - 2].first;
  if (a >= max + ulp_at_max / 2) return sign | f.inf_bits;  // ties at the threshold round to inf (even)
  auto hi = std::lower_bound(table.begin(), table.end(), std::make_pair(a, uint16_t{0}));
  if (hi == table.end()) return sign | table.back().second;
  if (hi->first == a || hi == table.begin()) return sign | hi->second;
  auto lo = hi - 1;
  const double dlo = a - lo->first, dhi = hi->first - a;
  if (dlo < dhi) return sign | lo->second;
  if (dhi < dlo) return sign | hi->second;
  return sign | ((lo->second & 1) == 0 ? lo->second : hi->second);
}

const Format kHalf{half_bits_to_float, 0x7c00};
const Format kBF16{bf16_bits_to_float, 0x7f80};

TEST(Half, EveryEncodingRoundTrips) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const auto bits = static_cast<uint16_t>(b);
    const float h = half_bits_to_float(bits);
    if (std::isnan(h)) {
      EXPECT_TRUE(std::isnan(half_bits_to_float(float_to_half_bits(h))));
      continue;
    }
    EXPECT_EQ(float_to_half_bits(h), bits) << "half bits " << b;
    const float bf = bf16_bits_to_float(bits);
    if (!std::isnan(bf)) EXPECT_EQ(float_to_bf16_bits(bf), bits) << "bf16 bits " << b;
  }
}

TEST(Half, RandomFloatsRoundToNearestEven) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 200000; ++i) {
    // Random bit patterns in the range the formats care about.
    const uint32_t bits = static_cast<uint32_t>(rng());
    const float f = bits_float(bits);
    if (!std::isfinite(f)) continue;
    ASSERT_EQ(float_to_half_bits(f), reference_round(f, kHalf)) << "f16 of " << f;
    ASSERT_EQ(float_to_bf16_bits(f), reference_round(f, kBF16)) << "bf16 of " << f;
  }
}

TEST(Half, MidpointsTieToEven) {
  // Every midpoint between two adjacent positive halves, exactly.
  for (uint16_t b = 0; b < 0x7bff; ++b) {
    const double lo = half_bits_to_float(b), hi = half_bits_to_float(static_cast<uint16_t>(b + 1));
    const float mid = static_cast<float>((lo + hi) / 2);  // exact in f32
    const uint16_t even = (b & 1) == 0 ? b : static_cast<uint16_t>(b + 1);
    ASSERT_EQ(float_to_half_bits(mid), even) << "midpoint above bits " << b;
    ASSERT_EQ(float_to_half_bits(-mid), even | 0x8000) << "negative midpoint above bits " << b;
  }
}

TEST(Half, OverflowSaturatesToInfinityAndNaNPropagates) {
  EXPECT_EQ(float(Half(65504.0f)), 65504.0f);
  EXPECT_EQ(float(Half(65519.0f)), 65504.0f);  // below max + half ulp (65520)
  EXPECT_TRUE(std::isinf(float(Half(65520.0f))));
  EXPECT_TRUE(std::isinf(float(Half(70000.0f))));
  EXPECT_TRUE(std::isinf(float(Half(-1e30f))) && float(Half(-1e30f)) < 0);
  EXPECT_TRUE(std::isnan(float(Half(NAN))));
  EXPECT_TRUE(std::isnan(float(BFloat16(NAN))));
  EXPECT_TRUE(std::isinf(float(BFloat16(3.4e38f))));  // rounds past bf16's max
  EXPECT_EQ(float(Half(5.9604645e-08f)), 5.9604645e-08f);  // smallest subnormal
  EXPECT_EQ(float(Half(2.9e-08f)), 0.0f);                  // below half of it
}

TEST(Half, DoubleConvertsWithASingleRounding) {
  // 1 + 2^-11 + 2^-40: nearest half is 1 + 2^-10; rounding to f32 first
  // would tie at 1 + 2^-11 and round to even (1.0).
  const double x = 1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40);
  EXPECT_EQ(float(Half(x)), 1.0f + std::ldexp(1.0f, -10));
  const uint64_t seed = testing::fresh_seed();
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(-70000, 70000);
  for (int i = 0; i < 100000; ++i) {
    const double d = dist(rng);
    ASSERT_EQ(Half(d).bits, reference_round(d, kHalf)) << d << " seed " << seed;
    ASSERT_EQ(BFloat16(d).bits, reference_round(d, kBF16)) << d << " seed " << seed;
  }
}

}  // namespace
}  // namespace mpt
