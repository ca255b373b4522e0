#pragma once
// Host-side float8 storage types with the GPU's conversions, bit for bit
// what cuda_fp8.h's __nv_cvt_* functions produce, so that FP8 casts and
// their overflow behaviour can be reproduced and tested on the CPU:
//
//   e4m3 (OCP "E4M3FN"): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no
//   infinities, NaN is 0x7F and 0xFF, the largest finite value 448.
//   e5m2: 1 sign, 5 exponent (bias 15), 2 mantissa bits, the top byte of
//   an f16; infinities 0x7C and 0xFC, NaNs above them, largest finite 57344.
//
// Rounding is to nearest, ties to even, subnormals included. NaN in gives
// 0x7F in either format, its sign dropped (cvt canonicalises NaN). Past the
// largest finite value, after rounding, the result depends on saturation.
// Decoding goes through f16, which holds every value of both formats; any
// NaN code decodes to the f16 NaN 0x7FFF (float 0x7FFFE000), as cvt does.
#include <cmath>
#include <cstdint>

#include "tensor/half.h"

namespace mpt {

enum class Fp8Format : uint8_t { e4m3, e5m2 };

// What a value past the largest finite one becomes. `none` (a plain cast,
// as PyTorch's .to(float8) and CUDA's __NV_NOSAT): NaN in e4m3, which has no
// infinity, infinity in e5m2. `finite` (__NV_SATFINITE, what FP8 training
// recipes use on scaled values): the largest finite value of that sign,
// infinities included.
enum class Fp8Saturation : uint8_t { none, finite };

inline constexpr uint8_t kFp8NaN = 0x7F;

namespace fp8_detail {

struct Layout {
  int mantissa_bits;
  int bias;
  uint8_t max_finite;  // the largest finite magnitude's code
  uint8_t overflow;    // without saturation: NaN (e4m3) or infinity (e5m2)
  bool has_infinity;
};

inline constexpr Layout kE4M3{3, 7, 0x7E, 0x7F, false};
inline constexpr Layout kE5M2{2, 15, 0x7B, 0x7C, true};

inline const Layout& layout(Fp8Format f) { return f == Fp8Format::e4m3 ? kE4M3 : kE5M2; }

}  // namespace fp8_detail

inline uint8_t float_to_fp8_bits(float f, Fp8Format format, Fp8Saturation saturation = Fp8Saturation::none) {
  const fp8_detail::Layout& l = fp8_detail::layout(format);
  const uint32_t x = float_bits(f);
  const auto sign = static_cast<uint8_t>((x >> 24) & 0x80u);
  const uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return kFp8NaN;
  const int m = l.mantissa_bits;
  const uint32_t smallest_normal = static_cast<uint32_t>(127 - l.bias + 1) << 23;
  uint32_t code;
  if (a < smallest_normal) {
    // Count units of the smallest subnormal, 2^(1 - bias - m): the scaling
    // is exact and nearbyint rounds half to even. A count of 2^m is the
    // smallest normal's code.
    code = static_cast<uint32_t>(std::nearbyint(bits_float(a) * std::ldexp(1.0f, l.bias + m - 1)));
  } else {
    // Round the dropped mantissa bits to nearest even (a carry moves into
    // the exponent), then rebias the exponent from 127 to the format's.
    const int drop = 23 - m;
    const uint32_t rounded = a + ((1u << (drop - 1)) - 1u) + ((a >> drop) & 1u);
    code = (rounded >> drop) - (static_cast<uint32_t>(127 - l.bias) << m);
  }
  if (code > l.max_finite) code = saturation == Fp8Saturation::finite ? l.max_finite : l.overflow;
  return static_cast<uint8_t>(sign | code);
}

// Rounded once, as __nv_cvt_double_to_fp8 does: the round-to-odd float keeps
// enough bits for a second rounding to 2 or 3 mantissa bits to equal the
// first (every value that can round to a nonzero fp8 code is a normal
// float). NaN gives 0x7F, as from a float.
inline uint8_t double_to_fp8_bits(double d, Fp8Format format, Fp8Saturation saturation = Fp8Saturation::none) {
  return float_to_fp8_bits(double_to_float_round_odd(d), format, saturation);
}

// f16 and bf16 widen to float exactly, so through float is one rounding of
// the same value: what cvt from f16 gives directly.
inline uint8_t half_bits_to_fp8_bits(uint16_t h, Fp8Format format,
                                     Fp8Saturation saturation = Fp8Saturation::none) {
  return float_to_fp8_bits(half_bits_to_float(h), format, saturation);
}
inline uint8_t bf16_bits_to_fp8_bits(uint16_t b, Fp8Format format,
                                     Fp8Saturation saturation = Fp8Saturation::none) {
  return float_to_fp8_bits(bf16_bits_to_float(b), format, saturation);
}

// Exact: f16's 5 exponent bits and 10 mantissa bits cover both formats,
// the smallest e4m3 subnormal (2^-9) included.
inline uint16_t fp8_bits_to_half_bits(uint8_t b, Fp8Format format) {
  const fp8_detail::Layout& l = fp8_detail::layout(format);
  const auto sign = static_cast<uint16_t>((b & 0x80u) << 8);
  const uint32_t magnitude = b & 0x7Fu;
  if (l.has_infinity ? magnitude > 0x7Cu : magnitude == 0x7Fu) return 0x7FFF;
  if (l.has_infinity && magnitude == 0x7Cu) return static_cast<uint16_t>(sign | 0x7C00u);
  const int m = l.mantissa_bits;
  const uint32_t exponent = magnitude >> m, mantissa = magnitude & ((1u << m) - 1u);
  if (exponent == 0) {
    // Zero or a subnormal: mantissa units of 2^(1 - bias - m), exact in
    // float and in f16.
    const float v = static_cast<float>(mantissa) * std::ldexp(1.0f, 1 - l.bias - m);
    return static_cast<uint16_t>(sign | float_to_half_bits(v));
  }
  return static_cast<uint16_t>(sign | ((exponent - l.bias + 15) << 10) | (mantissa << (10 - m)));
}

inline float fp8_bits_to_float(uint8_t b, Fp8Format format) {
  return half_bits_to_float(fp8_bits_to_half_bits(b, format));
}

// A plain cast from float or double does not saturate (Fp8Saturation::none),
// as PyTorch's .to(torch.float8_*) does not; the recipes' saturating cast is
// float_to_fp8_bits(f, format, Fp8Saturation::finite).
template <Fp8Format kFormat>
struct Float8 {
  uint8_t bits = 0;
  Float8() = default;
  explicit Float8(float f) : bits(float_to_fp8_bits(f, kFormat)) {}
  explicit Float8(double d) : bits(double_to_fp8_bits(d, kFormat)) {}
  static Float8 from_bits(uint8_t b) {
    Float8 v;
    v.bits = b;
    return v;
  }
  operator float() const { return fp8_bits_to_float(bits, kFormat); }
};

using Float8E4M3 = Float8<Fp8Format::e4m3>;
using Float8E5M2 = Float8<Fp8Format::e5m2>;

static_assert(sizeof(Float8E4M3) == 1 && sizeof(Float8E5M2) == 1);

}  // namespace mpt
