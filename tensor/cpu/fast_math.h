#pragma once
// exp and GELU's 1 + erf in f32 written as plain arithmetic, so that a loop
// calling them vectorises (libm's expf and erff are a call per element).
// Softmax-shaped loops call exp once per score (in attention T^2 / 2 calls
// per head), GELU calls erf once per element of the widest activations.
#include <bit>
#include <cmath>
#include <cstdint>

namespace mpt::cpu {

// Always inlined: a call per element (through the PLT, in a shared library)
// would undo the vectorising these are written for.
#define MPT_FAST_MATH_INLINE [[gnu::always_inline]] inline

// exp(x) for f32 x, within 2 ulp of the exact value where that is a normal
// number; subnormal results follow from the product below, 0 below about
// -104, +inf above about 88.72, NaN for NaN.
//
// x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so r is exact), then
// exp(r) by Cephes' degree-6 polynomial for expf, and 2^n applied as two
// powers of two so that each stays a normal f32 across the whole range.
MPT_FAST_MATH_INLINE float exp_f32(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
  // NaN goes through as 0 (its integer conversion below would be undefined)
  // and comes back at the end.
  const float xc = x < -104.0f ? -104.0f : (x > 88.8f ? 88.8f : (x == x ? x : 0.0f));
  const float n = std::floor(xc * kLog2e + 0.5f);
  const float r = xc - n * kLn2High - n * kLn2Low;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t whole = static_cast<int32_t>(n);
  const int32_t half = whole / 2;
  const float first = std::bit_cast<float>((half + 127) << 23);
  const float second = std::bit_cast<float>((whole - half + 127) << 23);
  const float e = p * first * second;
  return x != x ? x : e;
}

// erfc(z) for z >= 0 (and +inf) within about 1.2e-7 of itself plus two
// exp_f32 errors: Numerical Recipes' Chebyshev fit ("erfcc"),
// t exp(-z^2 + P(t)) with t = 1 / (1 + z / 2). z^2 rounded to f32 would
// put an error of z^2 * 2^-24 into the exponent (a relative error of 1e-6
// at z = 4), so z is split into a head of 12 significant bits, whose square
// is exact, and the rest: exp(-z^2) = exp(-head^2) exp((head - z)(head + z)).
MPT_FAST_MATH_INLINE float erfc_nonnegative_f32(float z) {
  // Beyond 9.1946 erfc is below f32's smallest normal number: 0, without
  // letting a subnormal into the arithmetic (each costs a slow microcode
  // assist) or inf into head - z.
  const bool beyond = z > 9.1946f;
  z = beyond ? 9.1946f : z;
  const float t = 1.0f / (1.0f + 0.5f * z);
  float p = 0.17087277f;
  p = p * t - 0.82215223f;
  p = p * t + 1.48851587f;
  p = p * t - 1.13520398f;
  p = p * t + 0.27886807f;
  p = p * t - 0.18628806f;
  p = p * t + 0.09678418f;
  p = p * t + 0.37409196f;
  p = p * t + 1.00002368f;
  p = p * t - 1.26551223f;
  const float head = std::bit_cast<float>(std::bit_cast<uint32_t>(z) & 0xffffe000u);
  const float value = t * exp_f32(-head * head) * exp_f32((head - z) * (head + z) + p);
  return beyond ? 0.0f : value;
}

// 1 + erf(u) with a small relative error everywhere, where GELU needs it:
// for u < 0 it is erfc(-u) itself, which 1 + erf(u) computed as written
// would lose to cancellation.
MPT_FAST_MATH_INLINE float one_plus_erf_f32(float u) {
  const float c = erfc_nonnegative_f32(std::fabs(u));
  return u < 0.0f ? c : 2.0f - c;
}

#undef MPT_FAST_MATH_INLINE

}  // namespace mpt::cpu
