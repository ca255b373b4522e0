#pragma once
// Internal: the kernel launchers behind the CUDA backend. cuda_backend.cpp
// checks operands and prepares these arguments; the .cu files only launch.
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "tensor/backend.h"
#include "tensor/dtype.h"
#include "tensor/shape.h"

namespace mpt::cuda {

// Throws DTypeError naming the op (out of line: kernel files stay free of fmt).
[[noreturn]] void throw_dtype_unsupported(const char* op, DType dtype);

struct Launch {
  int device = 0;
  cudaStream_t stream = nullptr;
  int sm_count = 1;
};

// Division by a fixed d in [1, 2^31] as a multiply-high, add and shift
// (Granlund & Montgomery, as in PyTorch's IntDivider), exact for dividends
// below 2^31. Integer division would dominate the strided kernels otherwise.
struct FastDivisor {
  uint32_t magic = 1;
  uint32_t shift = 0;

  FastDivisor() = default;
  explicit FastDivisor(uint32_t d) {
    while ((uint64_t(1) << shift) < d) ++shift;
    magic = static_cast<uint32_t>(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d)) / d + 1);
  }
};

// N operands walked together over one shape (operand 0 is the output), with
// size-1 dimensions dropped and mergeable neighbours merged, and dimensions
// stored innermost first. Fully contiguous operands end up as one dimension
// of stride 1, which the kernels take as their fast path.
template <int N>
struct Strided {
  void* data[N] = {};
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[N][kMaxDims] = {};
  FastDivisor divisors[kMaxDims];  // of shape[d], where shape[d] < 2^31

  // Call once the shape is final.
  void prepare_divisors() {
    for (int d = 0; d < ndim; ++d)
      if (shape[d] < (int64_t(1) << 31)) divisors[d] = FastDivisor(static_cast<uint32_t>(shape[d]));
  }

  bool contiguous() const {
    if (ndim == 0) return true;
    if (ndim > 1) return false;
    for (int n = 0; n < N; ++n)
      if (strides[n][0] != 1) return false;
    return true;
  }
};

// All operands share `dtype` (f32, f16, bf16, f64).
void launch_unary(const Launch& l, UnaryOp op, DType dtype, const Strided<2>& s, int64_t n, double alpha,
                  double beta);
void launch_binary(const Launch& l, BinaryOp op, DType dtype, const Strided<3>& s, int64_t n);
// f32 out from one f32 and one f16/bf16 input, widened on load.
bool binary_wide_supported(DType out, DType a, DType b);
void launch_binary_wide(const Launch& l, BinaryOp op, DType a, DType b, const Strided<3>& s, int64_t n);

// Element-wise conversion, any dtypes.
void launch_copy(const Launch& l, DType dst, DType src, const Strided<2>& s, int64_t n);
// Writes the element_size-byte pattern `bits` everywhere.
void launch_fill(const Launch& l, const Strided<1>& s, size_t element_size, uint64_t bits, int64_t n);
// Contiguous out.
void launch_arange(const Launch& l, void* out, DType dtype, int64_t n, double start, double step);
void launch_random(const Launch& l, void* out, DType dtype, int64_t n, uint64_t seed, uint64_t offset, bool normal,
                   double a, double b);

// in: contiguous [outer, k, inner] of in_dtype; out: contiguous [outer, inner]
// of in_dtype, or i64 for argmax.
void launch_reduce(const Launch& l, ReduceOp op, DType in_dtype, const void* in, void* out, int64_t outer,
                   int64_t k, int64_t inner);

// Row gather out[i, :] = table[idx[i], :] of raw elements; [n, d] rows of a
// table of `rows` rows. An index outside it gives a zero row (the index
// check reports it).
void launch_gather_rows(const Launch& l, void* out, const void* table, const int64_t* idx, size_t element_size,
                        int64_t rows, int64_t n, int64_t d);
// table[idx[i], :] += src[i, :] (f32, f64, f16, bf16), the same bits every
// run: each row's terms are added in the order of their positions, in
// chunks, without atomics (sums in f32, f64 for f64). Indices outside the
// table's `rows` are left out. `scratch` holds
// scatter_add_rows_scratch_bytes(...) bytes on the launch's device, free to
// reuse once the launch's stream has passed this work.
size_t scatter_add_rows_scratch_bytes(DType dtype, int64_t rows, int64_t n, int64_t d);
void launch_scatter_add_rows(const Launch& l, DType dtype, void* table, const int64_t* idx, const void* src,
                             int64_t rows, int64_t n, int64_t d, void* scratch);

// NCHW max pooling; x_shape is [N, C, H, W], the output [N, C, ho, wo].
void launch_max_pool2d_forward(const Launch& l, DType dtype, void* out, int64_t* indices, const void* x,
                               const int64_t* x_shape, int64_t ho, int64_t wo, const Pool2dParams& p);
void launch_max_pool2d_backward(const Launch& l, DType dtype, void* grad_x, const void* grad_out,
                                const int64_t* indices, const int64_t* x_shape, int64_t ho, int64_t wo,
                                const Pool2dParams& p);

}  // namespace mpt::cuda
