// float8 conversions (tensor/fp8.h) over all 256 codes of each format
// against an independent reference built from the bit fields, and at every
// rounding boundary: midpoints tie to even, overflow with and without
// saturation, NaN and infinity in, signed zeros, subnormals.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "tensor/fp8.h"

namespace mpt {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr Fp8Saturation kNoSat = Fp8Saturation::none;
constexpr Fp8Saturation kSatFinite = Fp8Saturation::finite;

struct Spec {
  Fp8Format format;
  const char* name;
  int exponent_bits, mantissa_bits;
  bool has_infinity;  // e5m2: IEEE-style top exponent; e4m3fn: only all-ones is NaN
  double max_finite, min_subnormal;
  uint8_t max_code, overflow_code;  // the largest finite magnitude; past it without saturation
};

const Spec kE4M3{Fp8Format::e4m3, "e4m3", 4, 3, false, 448.0, 0x1p-9, 0x7E, 0x7F};
const Spec kE5M2{Fp8Format::e5m2, "e5m2", 5, 2, true, 57344.0, 0x1p-16, 0x7B, 0x7C};
const Spec kSpecs[] = {kE4M3, kE5M2};

// The value a code stands for, from its sign, exponent and mantissa fields.
double reference_value(const Spec& s, uint8_t code) {
  const int bias = (1 << (s.exponent_bits - 1)) - 1;
  const int top = (1 << s.exponent_bits) - 1;
  const int e = (code >> s.mantissa_bits) & top;
  const int m = code & ((1 << s.mantissa_bits) - 1);
  const double sign = code & 0x80 ? -1.0 : 1.0;
  if (s.has_infinity && e == top) return m == 0 ? sign * HUGE_VAL : std::nan("");
  if (!s.has_infinity && e == top && m == (1 << s.mantissa_bits) - 1) return std::nan("");
  const double magnitude = e == 0 ? m * std::pow(2.0, 1 - bias - s.mantissa_bits)
                                  : (1.0 + m * std::pow(2.0, -s.mantissa_bits)) * std::pow(2.0, e - bias);
  return sign * magnitude;
}

float value(const Spec& s, uint8_t code) { return fp8_bits_to_float(code, s.format); }

TEST(Fp8, EveryCodeDecodesToItsFieldsValue) {
  for (const Spec& s : kSpecs) {
    int nans = 0, infinities = 0;
    double largest = 0, smallest = HUGE_VAL;
    for (int c = 0; c < 256; ++c) {
      const auto code = static_cast<uint8_t>(c);
      const double want = reference_value(s, code);
      const float got = value(s, code);
      if (std::isnan(want)) {
        ++nans;
        ASSERT_TRUE(std::isnan(got)) << s.name << " code " << c;
        EXPECT_EQ(float_bits(got), 0x7FFFE000u) << s.name << " code " << c;  // f16's 0x7FFF, widened
        EXPECT_EQ(fp8_bits_to_half_bits(code, s.format), 0x7FFF);
        continue;
      }
      ASSERT_EQ(static_cast<double>(got), want) << s.name << " code " << c;
      ASSERT_EQ(std::signbit(got), (c & 0x80) != 0) << s.name << " code " << c;  // -0 too
      EXPECT_EQ(float_bits(half_bits_to_float(fp8_bits_to_half_bits(code, s.format))), float_bits(got));
      if (std::isinf(want)) {
        ++infinities;
      } else if (want > 0) {
        largest = std::max(largest, want);
        smallest = std::min(smallest, want);
      }
    }
    EXPECT_EQ(nans, s.has_infinity ? 6 : 2) << s.name;
    EXPECT_EQ(infinities, s.has_infinity ? 2 : 0) << s.name;
    EXPECT_EQ(largest, s.max_finite) << s.name;
    EXPECT_EQ(smallest, s.min_subnormal) << s.name;
    EXPECT_EQ(value(s, s.max_code), s.max_finite);
  }
  EXPECT_EQ(value(kE4M3, 0x38), 1.0f);
  EXPECT_EQ(value(kE4M3, 0x08), 0x1p-6f);  // smallest normal
  EXPECT_EQ(value(kE5M2, 0x3C), 1.0f);
  EXPECT_EQ(value(kE5M2, 0x04), 0x1p-14f);
  // e5m2 is the top byte of an f16.
  for (int c = 0; c < 256; ++c)
    if (!std::isnan(value(kE5M2, static_cast<uint8_t>(c))))
      EXPECT_EQ(fp8_bits_to_half_bits(static_cast<uint8_t>(c), Fp8Format::e5m2), c << 8);
}

TEST(Fp8, EveryCodeRoundTripsThroughEveryWiderFormat) {
  for (const Spec& s : kSpecs)
    for (int c = 0; c < 256; ++c) {
      const auto code = static_cast<uint8_t>(c);
      const float v = value(s, code);
      if (std::isnan(v)) continue;
      const bool infinite = std::isinf(v);
      // Saturation turns an infinity into the largest finite value.
      const uint8_t saturated = infinite ? static_cast<uint8_t>((code & 0x80) | s.max_code) : code;
      ASSERT_EQ(float_to_fp8_bits(v, s.format, kNoSat), code) << s.name << " code " << c;
      ASSERT_EQ(float_to_fp8_bits(v, s.format, kSatFinite), saturated) << s.name << " code " << c;
      ASSERT_EQ(double_to_fp8_bits(v, s.format), code) << s.name << " code " << c;
      ASSERT_EQ(half_bits_to_fp8_bits(fp8_bits_to_half_bits(code, s.format), s.format), code);
      ASSERT_EQ(bf16_bits_to_fp8_bits(float_to_bf16_bits(v), s.format), code) << s.name << " code " << c;
      ASSERT_EQ(bf16_bits_to_float(float_to_bf16_bits(v)), v);  // bf16 holds every value of both
    }
  EXPECT_EQ(Float8E4M3(1.0f).bits, 0x38);
  EXPECT_EQ(float(Float8E4M3::from_bits(0xC4)), -3.0f);
  EXPECT_EQ(Float8E5M2(-2.0).bits, 0xC0);
}

// Each positive finite code and the next one up: their midpoint goes to the
// one with an even mantissa, anything nearer to a code goes to that code.
TEST(Fp8, MidpointsTieToEvenAndTheRestRoundToTheNearest) {
  for (const Spec& s : kSpecs)
    for (uint8_t lo = 0; lo < s.max_code; ++lo) {
      const auto hi = static_cast<uint8_t>(lo + 1);
      const float a = value(s, lo), b = value(s, hi);
      const float mid = (a + b) / 2;  // exact: a fifth significant bit at most
      ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(a) + b) / 2);
      const uint8_t even = (lo & 1) == 0 ? lo : hi;
      for (Fp8Saturation sat : {kNoSat, kSatFinite}) {
        ASSERT_EQ(float_to_fp8_bits(mid, s.format, sat), even) << s.name << " midpoint above code " << int(lo);
        ASSERT_EQ(float_to_fp8_bits(-mid, s.format, sat), even | 0x80) << s.name << " -midpoint " << int(lo);
        ASSERT_EQ(float_to_fp8_bits(std::nextafter(mid, kInf), s.format, sat), hi) << s.name << " " << int(lo);
        ASSERT_EQ(float_to_fp8_bits(std::nextafter(mid, 0.0f), s.format, sat), lo) << s.name << " " << int(lo);
        ASSERT_EQ(float_to_fp8_bits(-std::nextafter(mid, kInf), s.format, sat), hi | 0x80);
        ASSERT_EQ(float_to_fp8_bits(-std::nextafter(mid, 0.0f), s.format, sat), lo | 0x80);
        // A quarter of the way from each side.
        ASSERT_EQ(float_to_fp8_bits(a + (b - a) / 4, s.format, sat), lo) << s.name << " " << int(lo);
        ASSERT_EQ(float_to_fp8_bits(b - (b - a) / 4, s.format, sat), hi) << s.name << " " << int(lo);
      }
    }
}

// Past the largest finite value: the midpoint to where the next code would
// be rounds to even (e4m3's 464 down to 448, its next code being NaN; e5m2's
// 61440 up to infinity), then saturation decides.
TEST(Fp8, OverflowGivesNaNOrInfinityUnlessSaturating) {
  struct Case {
    const Spec& s;
    float x;
    uint8_t plain, saturated;
  };
  const std::vector<Case> cases = {
      {kE4M3, 448.0f, 0x7E, 0x7E},
      {kE4M3, 464.0f, 0x7E, 0x7E},
      {kE4M3, std::nextafter(464.0f, kInf), 0x7F, 0x7E},
      {kE4M3, 480.0f, 0x7F, 0x7E},
      {kE4M3, 1e30f, 0x7F, 0x7E},
      {kE4M3, std::numeric_limits<float>::max(), 0x7F, 0x7E},
      {kE4M3, kInf, 0x7F, 0x7E},
      {kE4M3, -std::nextafter(464.0f, kInf), 0xFF, 0xFE},  // NaN keeps the sign here: overflow, not NaN in
      {kE4M3, -kInf, 0xFF, 0xFE},
      {kE5M2, 57344.0f, 0x7B, 0x7B},
      {kE5M2, std::nextafter(61440.0f, 0.0f), 0x7B, 0x7B},
      {kE5M2, 61440.0f, 0x7C, 0x7B},
      {kE5M2, 65536.0f, 0x7C, 0x7B},
      {kE5M2, 1e30f, 0x7C, 0x7B},
      {kE5M2, kInf, 0x7C, 0x7B},
      {kE5M2, -61440.0f, 0xFC, 0xFB},
      {kE5M2, -kInf, 0xFC, 0xFB},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(float_to_fp8_bits(c.x, c.s.format, kNoSat), c.plain) << c.s.name << " of " << c.x;
    EXPECT_EQ(float_to_fp8_bits(c.x, c.s.format, kSatFinite), c.saturated) << c.s.name << " of " << c.x;
  }
  // The plain cast is the types' constructor.
  EXPECT_EQ(Float8E4M3(500.0f).bits, 0x7F);
  EXPECT_TRUE(std::isnan(float(Float8E4M3(500.0f))));
  EXPECT_EQ(float(Float8E5M2(-1e6)), -kInf);
}

TEST(Fp8, NaNInGivesThePositiveNaNCode) {
  const std::vector<uint32_t> nans = {0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF};
  for (const Spec& s : kSpecs) {
    for (uint32_t bits : nans)
      for (Fp8Saturation sat : {kNoSat, kSatFinite})
        EXPECT_EQ(float_to_fp8_bits(bits_float(bits), s.format, sat), kFp8NaN) << s.name << std::hex << " " << bits;
    EXPECT_EQ(double_to_fp8_bits(-std::nan(""), s.format), kFp8NaN);
    for (uint16_t h : {0x7E00, 0xFE00, 0x7C01, 0xFFFF})
      EXPECT_EQ(half_bits_to_fp8_bits(h, s.format), kFp8NaN) << s.name << std::hex << " f16 " << h;
    for (uint16_t b : {0x7FC0, 0xFFC0, 0x7F81})
      EXPECT_EQ(bf16_bits_to_fp8_bits(b, s.format), kFp8NaN) << s.name << std::hex << " bf16 " << b;
    EXPECT_TRUE(std::isnan(value(s, kFp8NaN)));
  }
  EXPECT_TRUE(std::isnan(float(Float8E4M3(kNaN))));
  EXPECT_TRUE(std::isnan(float(Float8E5M2(kNaN))));
}

TEST(Fp8, ZerosKeepTheirSign) {
  for (const Spec& s : kSpecs) {
    EXPECT_EQ(float_to_fp8_bits(0.0f, s.format), 0x00);
    EXPECT_EQ(float_to_fp8_bits(-0.0f, s.format), 0x80);
    EXPECT_EQ(double_to_fp8_bits(-0.0, s.format), 0x80);
    EXPECT_EQ(half_bits_to_fp8_bits(0x8000, s.format), 0x80);
    EXPECT_EQ(float_bits(value(s, 0x80)), 0x80000000u);
    EXPECT_EQ(fp8_bits_to_half_bits(0x80, s.format), 0x8000);
  }
}

// The smallest subnormal is exact; half of it ties to (signed) zero, just
// above half rounds up to it, and anything smaller flushes to zero.
TEST(Fp8, TinyValuesFlushToSignedZero) {
  for (const Spec& s : kSpecs) {
    const auto tiny = static_cast<float>(s.min_subnormal);
    for (Fp8Saturation sat : {kNoSat, kSatFinite}) {
      EXPECT_EQ(float_to_fp8_bits(tiny, s.format, sat), 0x01) << s.name;
      EXPECT_EQ(float_to_fp8_bits(-tiny, s.format, sat), 0x81) << s.name;
      EXPECT_EQ(float_to_fp8_bits(tiny / 2, s.format, sat), 0x00) << s.name;
      EXPECT_EQ(float_to_fp8_bits(-tiny / 2, s.format, sat), 0x80) << s.name;
      EXPECT_EQ(float_to_fp8_bits(std::nextafter(tiny / 2, 1.0f), s.format, sat), 0x01) << s.name;
      EXPECT_EQ(float_to_fp8_bits(tiny / 3, s.format, sat), 0x00) << s.name;
      EXPECT_EQ(float_to_fp8_bits(-1e-30f, s.format, sat), 0x80) << s.name;
      EXPECT_EQ(float_to_fp8_bits(std::numeric_limits<float>::denorm_min(), s.format, sat), 0x00) << s.name;
    }
    // The largest subnormal rounds up into the smallest normal.
    const float top_subnormal = value(s, static_cast<uint8_t>((1 << s.mantissa_bits) - 1));
    const float smallest_normal = value(s, static_cast<uint8_t>(1 << s.mantissa_bits));
    EXPECT_EQ(float_to_fp8_bits(std::nextafter((top_subnormal + smallest_normal) / 2, 1.0f), s.format),
              1 << s.mantissa_bits);
  }
}

// A double rounds once: just above a midpoint it rounds up even where the
// float nearest to it is the midpoint itself (which would tie to even).
TEST(Fp8, DoublesRoundOnce) {
  const double just_above = 1.0 + 0x1p-4 + 0x1p-40;  // e4m3 between 1 (0x38) and 1.125 (0x39)
  ASSERT_EQ(static_cast<float>(just_above), 1.0f + 0x1p-4f);
  EXPECT_EQ(float_to_fp8_bits(static_cast<float>(just_above), Fp8Format::e4m3), 0x38);
  EXPECT_EQ(double_to_fp8_bits(just_above, Fp8Format::e4m3), 0x39);
  EXPECT_EQ(Float8E4M3(just_above).bits, 0x39);
  EXPECT_EQ(double_to_fp8_bits(-(1.0 + 0x1p-3 + 0x1p-40), Fp8Format::e5m2), 0xBD);  // -1.25
  EXPECT_EQ(double_to_fp8_bits(1e300, Fp8Format::e4m3), 0x7F);
  EXPECT_EQ(double_to_fp8_bits(1e300, Fp8Format::e4m3, kSatFinite), 0x7E);
  EXPECT_EQ(double_to_fp8_bits(-1e-300, Fp8Format::e5m2), 0x80);
}

}  // namespace
}  // namespace mpt
