// Matrix products on the CPU through Eigen. Each operand is mapped in place
// as row- or column-major (whichever its unit stride says); 16-bit floats are
// widened to f32, multiplied with f32 accumulation and rounded back once,
// as cuBLAS does with CUBLAS_COMPUTE_32F.
#include <Eigen/Core>

#include "tensor/cpu/cpu_kernels.h"

namespace mpt::cpu {
namespace {

template <typename T, int Order>
using MatMap = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Order>, 0, Eigen::OuterStride<>>;
template <typename T>
using OutMap = Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;

// A [rows, cols] slice of a 3-d view as an Eigen map, for either unit stride.
template <typename T, typename F>
void with_matrix(const T* p, int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride, F&& f) {
  if (col_stride == 1 || cols == 1) {
    f(MatMap<T, Eigen::RowMajor>(p, rows, cols, Eigen::OuterStride<>(rows == 1 ? cols : row_stride)));
  } else {
    f(MatMap<T, Eigen::ColMajor>(p, rows, cols, Eigen::OuterStride<>(col_stride)));
  }
}

template <typename T>
void gemm_native(const GemmArgs& g, const T* a, const T* b, T* out, int64_t a_batch_stride, int64_t b_batch_stride) {
  const int64_t batch = g.out.shape[0], m = g.out.shape[1], n = g.out.shape[2], k = g.a.shape[2];
  for (int64_t i = 0; i < batch; ++i) {
    OutMap<T> c(out + i * m * n, m, n);
    with_matrix(a + i * a_batch_stride, m, k, g.a.strides[1], g.a.strides[2], [&](const auto& A) {
      with_matrix(b + i * b_batch_stride, k, n, g.b.strides[1], g.b.strides[2], [&](const auto& B) {
        if (g.beta == 0.0f) {
          c.noalias() = static_cast<T>(g.alpha) * (A * B);
        } else {
          c *= static_cast<T>(g.beta);
          c.noalias() += static_cast<T>(g.alpha) * (A * B);
        }
      });
    });
  }
}

// Copies a strided [batch, rows, cols] view of 16-bit floats into contiguous f32.
template <typename T>
std::vector<float> widen(const TensorView& v) {
  std::vector<float> w(static_cast<size_t>(v.numel()));
  const T* p = static_cast<const T*>(v.data);
  size_t i = 0;
  for (int64_t bi = 0; bi < v.shape[0]; ++bi)
    for (int64_t r = 0; r < v.shape[1]; ++r)
      for (int64_t c = 0; c < v.shape[2]; ++c)
        w[i++] = static_cast<float>(p[bi * v.strides[0] + r * v.strides[1] + c * v.strides[2]]);
  return w;
}

template <typename T>
void gemm_widened(const GemmArgs& g) {
  std::vector<float> a = widen<T>(g.a), b = widen<T>(g.b), c = widen<T>(g.out);
  GemmArgs wide = g;
  const int64_t m = g.out.shape[1], n = g.out.shape[2], k = g.a.shape[2];
  wide.a.strides[1] = k, wide.a.strides[2] = 1;
  wide.b.strides[1] = n, wide.b.strides[2] = 1;
  gemm_native<float>(wide, a.data(), b.data(), c.data(), m * k, k * n);
  T* out = static_cast<T*>(g.out.data);
  for (size_t i = 0; i < c.size(); ++i) out[i] = T(c[i]);
}

}  // namespace

void gemm(const GemmArgs& g) {
  switch (g.out.dtype) {
    case DType::f32:
      return gemm_native<float>(g, static_cast<const float*>(g.a.data), static_cast<const float*>(g.b.data),
                                static_cast<float*>(g.out.data), g.a.strides[0], g.b.strides[0]);
    case DType::f64:
      return gemm_native<double>(g, static_cast<const double*>(g.a.data), static_cast<const double*>(g.b.data),
                                 static_cast<double*>(g.out.data), g.a.strides[0], g.b.strides[0]);
    case DType::f16: return gemm_widened<Half>(g);
    case DType::bf16: return gemm_widened<BFloat16>(g);
    default: throw DTypeError(fmt::format("matmul: dtype {} is not supported", dtype_name(g.out.dtype)));
  }
}

}  // namespace mpt::cpu
