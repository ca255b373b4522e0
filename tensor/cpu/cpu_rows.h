#pragma once
// Internal to the CPU backend: the pieces the fused row kernels (layer norm,
// softmax cross-entropy) share. A row is worked on in f32 whatever its
// dtype: read in place where it is f32, else widened into a buffer first,
// so that the loops over it are plain f32 loops the compiler vectorizes.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "tensor/half.h"

namespace mpt::cpu {

// The n elements at src as f32: src itself for f32, else `buf` (n floats)
// filled with them.
template <typename T>
const float* widen_row(const T* src, int64_t n, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  }
}

// Where a row of T is written in f32: in place for f32, else `buf`, which
// store_row then rounds into place.
template <typename T>
float* f32_row(T* dst, float* buf) {
  if constexpr (std::is_same_v<T, float>) return dst;
  else return buf;
}
template <typename T>
void store_row(T* dst, const float* row, int64_t n) {
  if constexpr (!std::is_same_v<T, float>)
    for (int64_t i = 0; i < n; ++i) dst[i] = T(row[i]);  // rounds to nearest even (tensor/half.h)
}

// term(0) + ... + term(n - 1) in f32, in eight interleaved partial sums (the
// loop vectorizes, and the order depends only on n); over 2048 terms, the
// blocks' sums are added in double, so that a long row's sum does not drift
// (as cpu_reduce.cpp's sums do).
template <typename Term>
float row_sum(int64_t n, Term&& term) {
  constexpr int64_t kLanes = 8, kBlock = 2048;
  double total = 0;
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t j1 = std::min(n, j0 + kBlock);
    float lane[kLanes] = {};
    int64_t j = j0;
    for (; j + kLanes <= j1; j += kLanes)
      for (int64_t l = 0; l < kLanes; ++l) lane[l] += term(j + l);
    for (int64_t l = 0; j < j1; ++j, ++l) lane[l] += term(j);
    total += static_cast<double>(((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7])));
  }
  return static_cast<float>(total);
}

// The largest of x[0..n) (n >= 1) in eight interleaved running maxima, so
// that the loop vectorizes. A NaN never wins (the comparison is false);
// -inf where every element is NaN or -inf.
inline float row_max(const float* x, int64_t n) {
  constexpr int64_t kLanes = 8;
  float lane[kLanes];
  for (float& l : lane) l = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lane[l] = x[j + l] > lane[l] ? x[j + l] : lane[l];
  for (int64_t l = 0; j < n; ++j, ++l) lane[l] = x[j] > lane[l] ? x[j] : lane[l];
  float m = lane[0];
  for (int64_t l = 1; l < kLanes; ++l) m = lane[l] > m ? lane[l] : m;
  return m;
}

}  // namespace mpt::cpu
