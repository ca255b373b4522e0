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

// The bias epilogue on the [m, n] result `out`, held in Acc (f32 for 16-bit
// types: the bias is added before the single rounding, as cuBLASLt does).
template <typename Acc, typename T>
void add_bias(const GemmArgs& g, Acc* out) {
  if (!g.bias.data) return;
  const int64_t m = g.out.shape[1], n = g.out.shape[2];
  const T* bias = static_cast<const T*>(g.bias.data);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < n; ++c) out[r * n + c] += static_cast<Acc>(bias[c]);
}

// The relu epilogue, after the bias, in Acc; NaN stays NaN as in relu().
template <typename Acc>
void apply_relu(const GemmArgs& g, Acc* out) {
  if (!g.relu) return;
  const int64_t count = g.out.numel();
  for (int64_t i = 0; i < count; ++i)
    if (out[i] <= 0) out[i] = 0;
}

// The bias-gradient epilogue: bias_grad[i] = sum over k of a[i, k].
template <typename Acc, typename T>
void sum_rows_of_a(const GemmArgs& g) {
  if (!g.bias_grad.data) return;
  const T* a = static_cast<const T*>(g.a.data);
  T* sums = static_cast<T*>(g.bias_grad.data);
  for (int64_t i = 0; i < g.a.shape[1]; ++i) {
    Acc acc = 0;
    for (int64_t k = 0; k < g.a.shape[2]; ++k) acc += static_cast<Acc>(a[i * g.a.strides[1] + k * g.a.strides[2]]);
    sums[i] = static_cast<T>(acc);
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
  add_bias<float, T>(g, c.data());
  apply_relu<float>(g, c.data());
  sum_rows_of_a<float, T>(g);
  T* out = static_cast<T*>(g.out.data);
  for (size_t i = 0; i < c.size(); ++i) out[i] = T(c[i]);
}

template <typename T>
void gemm_full_precision(const GemmArgs& g) {
  gemm_native<T>(g, static_cast<const T*>(g.a.data), static_cast<const T*>(g.b.data), static_cast<T*>(g.out.data),
                 g.a.strides[0], g.b.strides[0]);
  add_bias<T, T>(g, static_cast<T*>(g.out.data));
  apply_relu<T>(g, static_cast<T*>(g.out.data));
  sum_rows_of_a<T, T>(g);
}

}  // namespace

void gemm(const GemmArgs& g) {
  check_gemm_epilogues(g);
  switch (g.out.dtype) {
    case DType::f32: return gemm_full_precision<float>(g);
    case DType::f64: return gemm_full_precision<double>(g);
    case DType::f16: return gemm_widened<Half>(g);
    case DType::bf16: return gemm_widened<BFloat16>(g);
    default: throw DTypeError(fmt::format("matmul: dtype {} is not supported", dtype_name(g.out.dtype)));
  }
}

}  // namespace mpt::cpu
