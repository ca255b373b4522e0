#pragma once
// Host-side f16 and bf16 storage types with IEEE round-to-nearest-even
// conversion, overflow to infinity and NaN propagation: bit for bit what the
// GPU's __float2half_rn / __float2bfloat16_rn produce, so a loss scaler's
// overflow behaviour can be reproduced and tested on the CPU.
#include <cmath>
#include <cstdint>
#include <cstring>

namespace mpt {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_half_bits(float f) {
  uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return static_cast<uint16_t>(sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (x < 0x38800000u) {
    // Below the smallest normal half (2^-14): count units of 2^-24. The
    // scaling is exact, and nearbyint rounds half to even.
    const float units = std::nearbyint(bits_float(x) * 16777216.0f);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(units));
  }
  x += 0xfffu + ((x >> 13) & 1u);  // round the 13 dropped bits to nearest even
  x -= 0x38000000u;                // rebias exponent 127 -> 15
  return static_cast<uint16_t>(sign | (x >> 13));
}

inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (mant << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

// A select rather than a branch for NaN, so that loops storing bf16
// vectorize.
inline uint16_t float_to_bf16_bits(float f) {
  const uint32_t x = float_bits(f);
  const uint32_t rounded = x + 0x7fffu + ((x >> 16) & 1u);  // to nearest even
  const uint32_t quiet_nan = x | 0x400000u;
  return static_cast<uint16_t>(((x & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded) >> 16);
}

inline float bf16_bits_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

// double -> float with round-to-odd: rounding that result once more to a type
// with at least two fewer significand bits (f16, bf16) equals rounding the
// double directly, as the GPU's __double2half does.
inline float double_to_float_round_odd(double d) {
  float f = static_cast<float>(d);
  if (std::isnan(d) || static_cast<double>(f) == d) return f;
  if (std::fabs(static_cast<double>(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);
  return bits_float(float_bits(f) | 1u);
}

struct Half {
  uint16_t bits = 0;
  Half() = default;
  explicit Half(float f) : bits(float_to_half_bits(f)) {}
  explicit Half(double d) : bits(float_to_half_bits(double_to_float_round_odd(d))) {}
  static Half from_bits(uint16_t b) {
    Half h;
    h.bits = b;
    return h;
  }
  operator float() const { return half_bits_to_float(bits); }
};

struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  explicit BFloat16(float f) : bits(float_to_bf16_bits(f)) {}
  explicit BFloat16(double d) : bits(float_to_bf16_bits(double_to_float_round_odd(d))) {}
  static BFloat16 from_bits(uint16_t b) {
    BFloat16 h;
    h.bits = b;
    return h;
  }
  operator float() const { return bf16_bits_to_float(bits); }
};

static_assert(sizeof(Half) == 2 && sizeof(BFloat16) == 2);

}  // namespace mpt
