#pragma once
// Internal to the CPU backend: element access by dtype and a strided loop
// over any number of operands.
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "tensor/backend.h"
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

// Calls f(T{}) for the tensor's dtype.
template <typename F>
inline void dispatch_float(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::f32: return f(float{});
    case DType::f64: return f(double{});
    case DType::f16: return f(Half{});
    case DType::bf16: return f(BFloat16{});
    default: throw DTypeError(fmt::format("{}: dtype {} is not supported (floating types only)", op, dtype_name(t)));
  }
}

template <typename F>
inline void dispatch_all(DType t, F&& f) {
  switch (t) {
    case DType::f32: return f(float{});
    case DType::f64: return f(double{});
    case DType::f16: return f(Half{});
    case DType::bf16: return f(BFloat16{});
    case DType::i32: return f(int32_t{});
    case DType::i64: return f(int64_t{});
    case DType::u8: return f(uint8_t{});
  }
}

// Visits every innermost row of `shape` (the last dimension), handing the
// row's starting element offset in each of N operands, the row length and
// the operands' strides along it.
template <size_t N, typename Row>
void for_each_row(const TensorView& shape, const std::array<const int64_t*, N>& strides, Row&& row) {
  const int nd = shape.ndim;
  std::array<int64_t, N> off{};
  if (nd == 0) {
    std::array<int64_t, N> zero{};
    row(off, int64_t{1}, zero);
    return;
  }
  const int64_t n = shape.numel();
  if (n == 0) return;
  const int64_t inner = shape.shape[nd - 1];
  std::array<int64_t, N> inner_stride;
  for (size_t k = 0; k < N; ++k) inner_stride[k] = strides[k][nd - 1];
  int64_t idx[kMaxDims] = {};
  for (int64_t r = 0, rows = n / inner; r < rows; ++r) {
    row(off, inner, inner_stride);
    for (int d = nd - 2; d >= 0; --d) {
      for (size_t k = 0; k < N; ++k) off[k] += strides[k][d];
      if (++idx[d] < shape.shape[d]) break;
      for (size_t k = 0; k < N; ++k) off[k] -= strides[k][d] * shape.shape[d];
      idx[d] = 0;
    }
  }
}

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

}  // namespace mpt::cpu
