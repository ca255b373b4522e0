// Matrix products on the CPU: through oneDNN where it runs them
// (onednn_matmul.h: f32, and bf16 where the CPU has bf16 arithmetic), else
// through Eigen. For Eigen each operand is mapped in place as row- or
// column-major (whichever its unit stride says). 16-bit floats that oneDNN
// does not take as they are are widened to f32, multiplied with f32
// accumulation (by oneDNN or Eigen) and rounded back once, as cuBLAS does
// with CUBLAS_COMPUTE_32F.
#include <Eigen/Core>
#include <algorithm>
#include <memory>
#include <type_traits>
#include <vector>

#include "tensor/cpu/cpu_kernels.h"
#include "tensor/cpu/cpu_threads.h"
#include "tensor/cpu/host_block_cache.h"
#include "tensor/cpu/onednn_matmul.h"

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

// A product large enough is split over the CPU's threads (cpu_threads.h)
// in blocks of whole output rows, or columns where there are more of those;
// each thread runs Eigen's product on its block. A block spans a multiple of
// kBlockGrain rows or columns (Eigen's register tiles stay whole) and at
// least kMinMultiplyAddsPerPiece multiply-adds.
constexpr int64_t kBlockGrain = 16;

template <typename T>
void gemm_native(const GemmArgs& g, const T* a, const T* b, T* out, int64_t a_batch_stride, int64_t b_batch_stride) {
  const int64_t batch = g.out.shape[0], m = g.out.shape[1], n = g.out.shape[2], k = g.a.shape[2];
  const bool by_rows = m >= n;
  const int64_t split = by_rows ? m : n;
  const int64_t min_grains = units_for_work(kMinMultiplyAddsPerPiece, kBlockGrain * (by_rows ? n : m) * k);
  for (int64_t i = 0; i < batch; ++i) {
    OutMap<T> c(out + i * m * n, m, n);
    with_matrix(a + i * a_batch_stride, m, k, g.a.strides[1], g.a.strides[2], [&](const auto& A) {
      with_matrix(b + i * b_batch_stride, k, n, g.b.strides[1], g.b.strides[2], [&](const auto& B) {
        parallel_for(split, kBlockGrain, min_grains, [&](int64_t begin, int64_t end) {
          const int64_t r0 = by_rows ? begin : 0, rows = by_rows ? end - begin : m;
          const int64_t c0 = by_rows ? 0 : begin, cols = by_rows ? n : end - begin;
          auto block = c.block(r0, c0, rows, cols);
          const auto product = A.middleRows(r0, rows) * B.middleCols(c0, cols);
          if (g.beta == 0.0f) {
            block.noalias() = static_cast<T>(g.alpha) * product;
          } else {
            block *= static_cast<T>(g.beta);
            block.noalias() += static_cast<T>(g.alpha) * product;
          }
        });
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
  parallel_for_elements(g.out.numel(), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = out[i] <= 0 ? Acc{0} : out[i];
  });
}

// The bias-gradient epilogue: bias_grad[i] = sum over k of a[i, k], added
// in double: over a batch of millions of rows an f32 running sum drifts
// (as prim::sum's blocks avoid), and the bias gradient would then depend
// on whether the weight wants one too.
//
// a is usually the transposed view of the output gradient (a weight
// gradient's dY^T), whose rows are strided: walked row by row, each sum
// would step across the whole gradient once (a cache miss an element). So
// each thread takes a range of rows and walks k in the outer loop, reading
// stretches of the gradient's own rows; every sum still adds its elements
// in order of k, so the result is the same either way.
template <typename Acc, typename T>
void sum_rows_of_a(const GemmArgs& g) {
  if (!g.bias_grad.data) return;
  const T* a = static_cast<const T*>(g.a.data);
  T* sums = static_cast<T*>(g.bias_grad.data);
  const int64_t rows = g.a.shape[1], ks = g.a.shape[2], row_stride = g.a.strides[1], k_stride = g.a.strides[2];
  constexpr int64_t kRowGrain = 64;
  parallel_for(rows, kRowGrain, units_for_work(int64_t{1} << 20, kRowGrain * ks), [&](int64_t begin, int64_t end) {
    std::vector<double> acc(static_cast<size_t>(end - begin), 0.0);
    for (int64_t k = 0; k < ks; ++k) {
      const T* column = a + k * k_stride;
      for (int64_t i = begin; i < end; ++i)
        acc[i - begin] += static_cast<double>(static_cast<Acc>(column[i * row_stride]));
    }
    for (int64_t i = begin; i < end; ++i) sums[i] = static_cast<T>(static_cast<Acc>(acc[i - begin]));
  });
}

// Whether a [batch, rows, cols] view's matrices are dense blocks (row- or
// column-major) lying back to back: its elements fill one stretch of memory.
bool is_dense_batch(const TensorView& v) {
  const int64_t rows = v.shape[1], cols = v.shape[2];
  const bool row_major = v.strides[2] == 1 && (rows == 1 || v.strides[1] == cols);
  const bool col_major = v.strides[1] == 1 && (cols == 1 || v.strides[2] == rows);
  return (row_major || col_major) && (v.shape[0] == 1 || v.strides[0] == rows * cols);
}

// Conversions are split into pieces of at least this many elements.
constexpr int64_t kConvertGrain = 1 << 14;

// A [batch, rows, cols] view of 16-bit floats widened to f32, and the view
// of the copy. A dense view keeps its layout and takes one linear pass
// (which vectorizes); any other is gathered into row-major order.
struct Widened {
  host_cache::Buffer<float> values;
  TensorView view;
};

template <typename T>
Widened widen(const TensorView& v) {
  const int64_t n = v.numel();
  Widened w{host_cache::make_buffer<float>(static_cast<size_t>(n)), v};
  w.view.data = w.values.get();
  w.view.dtype = DType::f32;
  const T* p = static_cast<const T*>(v.data);
  float* out = w.values.get();
  if (is_dense_batch(v)) {
    parallel_for(n, kConvertGrain, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) out[i] = static_cast<float>(p[i]);
    });
    return w;
  }
  size_t i = 0;
  for (int64_t bi = 0; bi < v.shape[0]; ++bi)
    for (int64_t r = 0; r < v.shape[1]; ++r)
      for (int64_t c = 0; c < v.shape[2]; ++c)
        out[i++] = static_cast<float>(p[bi * v.strides[0] + r * v.strides[1] + c * v.strides[2]]);
  w.view.strides[0] = v.shape[1] * v.shape[2];
  w.view.strides[1] = v.shape[2];
  w.view.strides[2] = 1;
  return w;
}

// Whether oneDNN may take the product: it computes out = a @ b (+ bias)
// only, without alpha and beta.
bool plain_product(const GemmArgs& g) { return g.alpha == 1.0f && g.beta == 0.0f; }

// The relu epilogue on the stored result: oneDNN's relu turns NaN into 0,
// so it runs here. Rounding to a 16-bit float keeps the sign and NaN, so
// relu after the rounding gives what relu before it would. On the bits,
// so that it vectorizes: a value is at most 0 where it is +0 or its bits
// lie from -0 to -infinity (above those are the negative NaNs).
template <typename T>
void apply_relu_stored(const GemmArgs& g) {
  if (!g.relu) return;
  constexpr uint16_t kNegativeInfinity = std::is_same_v<T, BFloat16> ? 0xff80 : 0xfc00;
  auto* bits = static_cast<uint16_t*>(g.out.data);
  parallel_for_elements(g.out.numel(), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      bits[i] = bits[i] >= 0x8000 && bits[i] <= kNegativeInfinity ? uint16_t{0} : bits[i];
  });
}

template <typename T>
void gemm_widened(const GemmArgs& g) {
  // bf16 operands as they are, where oneDNN has bf16 kernels for this CPU.
  if (plain_product(g) && onednn_matmul(g.a, g.b, g.out, g.bias)) {
    apply_relu_stored<T>(g);
    sum_rows_of_a<float, T>(g);
    return;
  }
  const Widened a = widen<T>(g.a), b = widen<T>(g.b);
  // The result in f32 (row-major, as the output is); its old values are
  // read only where beta asks for them.
  const int64_t count = g.out.numel();
  const host_cache::Buffer<float> result =
      g.beta != 0.0f ? widen<T>(g.out).values : host_cache::make_buffer<float>(static_cast<size_t>(count));
  float* c = result.get();
  GemmArgs wide = g;
  wide.a = a.view;
  wide.b = b.view;
  // oneDNN on the widened operands, with the bias widened to f32 (added
  // before the single rounding either way).
  TensorView c_view = g.out;
  c_view.data = c;
  c_view.dtype = DType::f32;
  std::vector<float> bias_f32;
  TensorView bias_view;
  if (g.bias.data) {
    const T* bias = static_cast<const T*>(g.bias.data);
    bias_f32.assign(bias, bias + g.bias.shape[0]);
    bias_view = g.bias;
    bias_view.data = bias_f32.data();
    bias_view.dtype = DType::f32;
  }
  if (!(plain_product(g) && onednn_matmul(a.view, b.view, c_view, bias_view))) {
    gemm_native<float>(wide, a.values.get(), b.values.get(), c, a.view.strides[0], b.view.strides[0]);
    add_bias<float, T>(g, c);
  }
  apply_relu<float>(g, c);
  sum_rows_of_a<float, T>(g);
  T* out = static_cast<T*>(g.out.data);
  parallel_for(count, kConvertGrain, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = T(c[i]);
  });
}

template <typename T>
void gemm_full_precision(const GemmArgs& g) {
  if constexpr (std::is_same_v<T, float>) {
    if (plain_product(g) && onednn_matmul(g.a, g.b, g.out, g.bias)) {
      apply_relu<T>(g, static_cast<T*>(g.out.data));
      sum_rows_of_a<T, T>(g);
      return;
    }
  }
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
