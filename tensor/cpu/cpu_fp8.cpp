// FP8 on the CPU: the same quantization as the GPU's (fp8.h's conversions
// are cuda_fp8.h's, bit for bit) and its products as f32 GEMMs of the
// decoded values, so every FP8 behaviour can be tested without a GPU and
// compared with it code for code.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "tensor/cpu/cpu_kernels.h"
#include "tensor/cpu/cpu_threads.h"
#include "tensor/fp8.h"

namespace mpt::cpu {
namespace {

Fp8Format format_of(DType t) { return t == DType::e4m3 ? Fp8Format::e4m3 : Fp8Format::e5m2; }

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// max |x| as the bit patterns of |x|: every NaN pattern lies above
// infinity's, so a NaN anywhere wins, as on the GPU (an atomicMax on the
// same patterns).
template <typename T>
uint32_t abs_max_bits(const T* in, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, float_bits(static_cast<float>(in[i])) & 0x7fffffffu);
  return m;
}

void combine_amax(const TensorView& amax, uint32_t bits) {
  float* a = static_cast<float*>(amax.data);
  *a = bits_float(std::max(float_bits(*a) & 0x7fffffffu, bits));
}

}  // namespace

void amax_into(const TensorView& amax, const TensorView& in) {
  dispatch_half_or_float(in.dtype, "amax", [&](auto tag) {
    using T = decltype(tag);
    combine_amax(amax, abs_max_bits(static_cast<const T*>(in.data), in.numel()));
  });
}

void quantize_fp8(const Fp8QuantizeArgs& q) {
  const int64_t rows = q.in.shape[0], cols = q.in.shape[1];
  const float scale = *static_cast<const float*>(q.scale.data);
  const Fp8Format format = format_of(q.out.dtype);
  auto* out = static_cast<uint8_t*>(q.out.data);
  auto* out_t = static_cast<uint8_t*>(q.out_t.data);
  dispatch_half_or_float(q.in.dtype, "quantize_fp8", [&](auto tag) {
    using T = decltype(tag);
    // The prologue's result, by the element-wise kernels that compute the op
    // alone: the same values, rounded the same.
    std::vector<T> applied;
    const T* in = static_cast<const T*>(q.in.data);
    if (q.prologue != Fp8Prologue::none) {
      applied.resize(static_cast<size_t>(rows * cols));
      TensorView result = q.in;
      result.data = applied.data();
      if (fp8_prologue_has_aux(q.prologue))
        binary(fp8_prologue_binary(q.prologue), result, q.in, q.aux);
      else
        unary(fp8_prologue_unary(q.prologue), result, q.in, 0.0, 0.0);
      in = applied.data();
    }
    auto value = [&](int64_t i) { return static_cast<float>(in[i]); };
    parallel_for(rows, 1, units_for_work(kMinElementsPerPiece, cols), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const uint8_t code = float_to_fp8_bits(value(r * cols + c) * scale, format, Fp8Saturation::finite);
          out[r * cols + c] = code;
          if (out_t) out_t[c * rows + r] = code;
        }
    });
    if (q.amax.data) combine_amax(q.amax, abs_max_bits(in, rows * cols));
    if (q.column_sums.data) {
      // Blocks of kFp8ColumnSumBlock rows in order, then the blocks' sums in
      // order: the GPU's order.
      float* sums = static_cast<float*>(q.column_sums.data);
      for (int64_t c = 0; c < cols; ++c) {
        float total = 0.0f;
        for (int64_t r0 = 0; r0 < rows; r0 += kFp8ColumnSumBlock) {
          float block = 0.0f;
          for (int64_t r = r0; r < std::min(rows, r0 + kFp8ColumnSumBlock); ++r) block += value(r * cols + c);
          total += block;
        }
        sums[c] = total;
      }
    }
  });
  *static_cast<float*>(q.scale_inv.data) = 1.0f / scale;
}

void gemm_fp8(const Fp8GemmArgs& g) {
  const int64_t m = g.a.shape[0], k = g.a.shape[1], n = g.b.shape[0];
  // Decoded exactly to f32, then one f32 product with the two scales folded
  // into alpha, as cuBLASLt folds them: D = (scale_a * scale_b) * (A B).
  auto decode = [](const TensorView& v) {
    const Fp8Format format = format_of(v.dtype);
    const auto* codes = static_cast<const uint8_t*>(v.data);
    std::vector<float> table(256), values(static_cast<size_t>(v.numel()));
    for (int c = 0; c < 256; ++c) table[c] = fp8_bits_to_float(static_cast<uint8_t>(c), format);
    for (size_t i = 0; i < values.size(); ++i) values[i] = table[codes[i]];
    return values;
  };
  std::vector<float> a = decode(g.a), b = decode(g.b);
  std::vector<float> product(static_cast<size_t>(m * n));
  GemmArgs f32;
  f32.a = matrix_view(a.data(), DType::f32, m, k, k, 1);
  f32.b = matrix_view(b.data(), DType::f32, k, n, 1, k);  // b [n, k] read as [k, n] through its strides: b^T
  f32.out = matrix_view(product.data(), DType::f32, m, n, n, 1);
  f32.alpha = *static_cast<const float*>(g.a_scale_inv.data) * *static_cast<const float*>(g.b_scale_inv.data);
  gemm(f32);
  dispatch_half_or_float(g.out.dtype, "gemm_fp8", [&](auto tag) {
    using T = decltype(tag);
    T* out = static_cast<T*>(g.out.data);
    const T* bias = static_cast<const T*>(g.bias.data);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < n; ++c) {
        float v = product[r * n + c];
        if (bias) v += static_cast<float>(bias[c]);
        if (g.relu && !std::isnan(v)) v = std::max(v, 0.0f);  // NaN stays NaN, as relu() keeps it
        out[r * n + c] = static_cast<T>(v);
      }
  });
}

}  // namespace mpt::cpu
