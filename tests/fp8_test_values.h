#pragma once
// Inputs the FP8 tests share: values over many binades (with the specials
// that quantization must handle), random finite codes of a format, and a
// tensor's codes on the host.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "tensor/fp8.h"
#include "tensor/ops.h"

namespace mpt::testing {

inline Fp8Format fp8_format_of(DType t) { return t == DType::e4m3 ? Fp8Format::e4m3 : Fp8Format::e5m2; }

// n values m * 2^e, m uniform in (-1, 1), e in [-16, 12]; with `specials`,
// +-inf, +-1e30 (past either format's range once scaled), +-0, 1e-30
// (below it) and NaN among the first nine.
inline std::vector<float> spread_values(size_t n, std::mt19937_64& rng, bool specials) {
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-16, 12);
  std::vector<float> v(n);
  for (auto& x : v) x = std::ldexp(mantissa(rng), exponent(rng));
  if (specials && n >= 9) {
    const float inf = std::numeric_limits<float>::infinity();
    v[1] = inf, v[2] = -inf, v[3] = 1e30f, v[4] = -1e30f, v[5] = 0.0f, v[6] = -0.0f, v[7] = 1e-30f, v[8] = NAN;
  }
  return v;
}

// A [rows, cols] host tensor of random finite codes of `format`.
inline Tensor random_codes(int64_t rows, int64_t cols, DType format, std::mt19937_64& rng) {
  Tensor t = Tensor::empty({rows, cols}, format);
  auto* p = static_cast<uint8_t*>(t.data_ptr());
  for (int64_t i = 0; i < t.numel(); ++i) {
    uint8_t c;
    do c = static_cast<uint8_t>(rng());
    while (!std::isfinite(fp8_bits_to_float(c, fp8_format_of(format))));
    p[i] = c;
  }
  return t;
}

// Every byte of a tensor's elements in row-major order, from any device.
inline std::vector<uint8_t> bytes_of(const Tensor& t) {
  const Tensor h = prim::contiguous(prim::to(t, kCPU));
  const auto* p = static_cast<const uint8_t*>(h.data_ptr());
  return std::vector<uint8_t>(p, p + h.nbytes());
}

}  // namespace mpt::testing
