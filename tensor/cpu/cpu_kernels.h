#pragma once
// Internal to the CPU backend: element access by dtype and a strided loop
// over any number of operands.
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "tensor/backend.h"
#include "tensor/dtype_dispatch.h"
#include "tensor/error.h"
#include "tensor/half.h"
#include "tensor/tensor_view.h"

namespace mpt::cpu {

// The type a kernel computes in: f32 for the 16-bit floats (as on the GPU).
template <typename T> struct ComputeType { using type = T; };
template <> struct ComputeType<Half> { using type = float; };
template <> struct ComputeType<BFloat16> { using type = float; };

template <typename T, typename C>
inline C load(const T* p) { return static_cast<C>(static_cast<typename ComputeType<T>::type>(*p)); }
template <typename T, typename C>
inline void store(T* p, C v) { *p = static_cast<T>(v); }
// Float to integer storage truncates, as static_cast does; to the 16-bit
// floats it rounds to nearest even (Half/BFloat16 constructors).

// Whether `candidate` takes the place of `current` in a running maximum
// (minimum): NaN wins, as in torch.amax, argmax and max pooling, and a tie
// keeps the earlier element. Bitwise, not short-circuit, operators: which
// element wins is data, and a branch on it mispredicts about half the time.
template <typename C>
inline bool beats_max(C candidate, C current) {
  return (candidate > current) | ((candidate != candidate) & (current == current));
}
template <typename C>
inline bool beats_min(C candidate, C current) {
  return (candidate < current) | ((candidate != candidate) & (current == current));
}

// Calls f(T{}) for the tensor's dtype.
template <typename F>
inline void dispatch_float(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::f32: return f(float{});
    case DType::f64: return f(double{});
    case DType::f16: return f(Half{});
    case DType::bf16: return f(BFloat16{});
    default: throw DTypeError(fmt::format("{}: dtype {} is not supported (f32, f16, bf16, f64)", op, dtype_name(t)));
  }
}

// Calls f(T{}) for the 16-bit floats and f32 (the fused kernels' dtypes).
template <typename F>
inline void dispatch_half_or_float(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::f32: return f(float{});
    case DType::f16: return f(Half{});
    case DType::bf16: return f(BFloat16{});
    default: throw DTypeError(fmt::format("{}: dtype {} is not supported (f32, f16, bf16)", op, dtype_name(t)));
  }
}

using mpt::dispatch_all;

// Visits every innermost row of `shape`, handing the row's starting
// element offset in each of N operands, the row length and the operands'
// strides along it. Adjacent dimensions that every operand steps through
// as one are merged first, so a [N, C, H, W] tensor plus a per-channel
// [1, C, 1, 1] one runs in rows of H * W, not W.
template <size_t N, typename Row>
void for_each_row(const TensorView& shape, const std::array<const int64_t*, N>& strides, Row&& row) {
  if (shape.ndim == 0) {
    std::array<int64_t, N> zero{};
    row(zero, int64_t{1}, zero);
    return;
  }
  if (shape.numel() == 0) return;
  // Merged dimensions, innermost last: sizes and each operand's strides.
  int nd = 0;
  int64_t size[kMaxDims];
  std::array<int64_t, N> step[kMaxDims];
  for (int d = 0; d < shape.ndim; ++d) {
    if (shape.shape[d] == 1) continue;
    bool merges = nd > 0;
    for (size_t k = 0; k < N && merges; ++k) merges = step[nd - 1][k] == strides[k][d] * shape.shape[d];
    if (merges) {
      size[nd - 1] *= shape.shape[d];
      for (size_t k = 0; k < N; ++k) step[nd - 1][k] = strides[k][d];
    } else {
      size[nd] = shape.shape[d];
      for (size_t k = 0; k < N; ++k) step[nd][k] = strides[k][d];
      ++nd;
    }
  }
  std::array<int64_t, N> off{};
  if (nd == 0) {  // every dimension of size 1
    row(off, int64_t{1}, off);
    return;
  }
  const int64_t inner = size[nd - 1];
  int64_t idx[kMaxDims] = {};
  for (int64_t r = 0, rows = shape.numel() / inner; r < rows; ++r) {
    row(off, inner, step[nd - 1]);
    for (int d = nd - 2; d >= 0; --d) {
      for (size_t k = 0; k < N; ++k) off[k] += step[d][k];
      if (++idx[d] < size[d]) break;
      for (size_t k = 0; k < N; ++k) off[k] -= step[d][k] * size[d];
      idx[d] = 0;
    }
  }
}

// A [1, rows, cols] view of host memory whose element (r, c) lies at
// data + r * row_stride + c * col_stride (a transpose swaps the strides):
// the operand layout of gemm() and onednn_matmul().
inline TensorView matrix_view(void* data, DType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                              int64_t col_stride) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.ndim = 3;
  v.shape[0] = 1, v.shape[1] = rows, v.shape[2] = cols;
  v.strides[0] = rows * cols, v.strides[1] = row_stride, v.strides[2] = col_stride;
  return v;
}

// dst = src converted, where both are contiguous of two different dtypes
// among f32, f16 and bf16 (else false, nothing done).
bool cast_dense(const TensorView& dst, const TensorView& src);
// Backend::scaled_copy_list (backend.h).
void scaled_copy_list(const std::vector<TensorView>& dsts, const std::vector<TensorView>& srcs, double scale);

void unary(UnaryOp op, const TensorView& out, const TensorView& in, double alpha, double beta);
void binary(BinaryOp op, const TensorView& out, const TensorView& a, const TensorView& b);
void reduce(ReduceOp op, const TensorView& out, const TensorView& in, int64_t outer, int64_t k, int64_t inner);
void gemm(const GemmArgs& args);
void index_select_rows(const TensorView& out, const TensorView& table, const TensorView& idx);
void index_add_rows(const TensorView& table, const TensorView& idx, const TensorView& src);
void conv2d_forward(const TensorView& out, const TensorView& x, const TensorView& w, const Conv2dParams& p);
void conv2d_backward_data(const TensorView& grad_x, const TensorView& grad_out, const TensorView& w,
                          const Conv2dParams& p);
void conv2d_backward_weight(const TensorView& grad_w, const TensorView& x, const TensorView& grad_out,
                            const Conv2dParams& p);
void max_pool2d_forward(const TensorView& out, const TensorView& indices, const TensorView& x, const Pool2dParams& p);
void max_pool2d_backward(const TensorView& grad_x, const TensorView& grad_out, const TensorView& indices);
void quantize_fp8(const Fp8QuantizeArgs& args);
void gemm_fp8(const Fp8GemmArgs& args);
void amax_into(const TensorView& amax, const TensorView& in);
// Fused layer norm (cpu_layer_norm.cpp) and softmax cross-entropy
// (cpu_cross_entropy.cpp): the Backend methods' contracts, for f32, f16
// and bf16 (f64 takes the composed path, whose math the gradient checks
// hold to finite differences).
bool fused_layer_norm_supported(DType dtype, DType out_dtype, int64_t d);
void layer_norm_forward(const TensorView& out, const TensorView& mean, const TensorView& rstd, const TensorView& x,
                        const TensorView& weight, const TensorView& bias, double eps);
void layer_norm_backward(const TensorView& grad_x, const TensorView& grad_x_narrow, const TensorView& grad_weight,
                         const TensorView& grad_bias, const TensorView& grad_out, const TensorView& grad_x_more,
                         const TensorView& x, const TensorView& weight, const TensorView& mean,
                         const TensorView& rstd);
bool fused_cross_entropy_supported(DType dtype);
void cross_entropy_forward(const TensorView& loss, const TensorView& lse, const TensorView& valid,
                           const TensorView& logits, const TensorView& target, int64_t ignore_index);
void cross_entropy_backward(const TensorView& grad, const TensorView& logits, const TensorView& target,
                            const TensorView& lse, const TensorView& row_scale);
// Whether the backend offers the fused layer norm, cross-entropy and attention
// (set_cpu_fused_kernels in tensor/backend_settings.h; on by default).
void set_fused_kernels(bool on);
bool fused_kernels();
// Fused attention (cpu_attention.cpp): Backend::attention_forward's and
// attention_backward's contracts, for f32, f16 and bf16.
bool attention_supported(DType dtype);
void attention_forward(const TensorView& out, const TensorView& lse, const TensorView& q, const TensorView& k,
                       const TensorView& v, bool causal, double scale);
void attention_backward(const TensorView& grad_q, const TensorView& grad_k, const TensorView& grad_v,
                        const TensorView& delta, const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const TensorView& lse, const TensorView& grad_out, bool causal,
                        double scale);

}  // namespace mpt::cpu
