// Unary and binary element-wise kernels: one kernel per dtype, with the op a
// runtime switch (uniform across the grid, so it costs no divergence) rather
// than a template parameter: 8 kernels instead of 8 x 36, for compile time.
// The formulas are those of tensor/cpu/cpu_elementwise.cpp, written the same
// way so that both round alike.
#include "tensor/cuda/gelu_math.cuh"
#include "tensor/cuda/kernel_utils.cuh"

namespace mpt::cuda {
namespace {

// The precise (not the fast-math) CUDA functions, by argument type (exp,
// tanh and erf in gelu_math.cuh).
__device__ __forceinline__ float m_log(float x) { return logf(x); }
__device__ __forceinline__ double m_log(double x) { return log(x); }
__device__ __forceinline__ float m_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double m_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float m_sin(float x) { return sinf(x); }
__device__ __forceinline__ double m_sin(double x) { return sin(x); }
__device__ __forceinline__ float m_cos(float x) { return cosf(x); }
__device__ __forceinline__ double m_cos(double x) { return cos(x); }
__device__ __forceinline__ float m_abs(float x) { return fabsf(x); }
__device__ __forceinline__ double m_abs(double x) { return fabs(x); }
__device__ __forceinline__ float m_pow(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double m_pow(double x, double y) { return pow(x, y); }

template <typename C>
__device__ __forceinline__ C unary_value(UnaryOp op, C x, C alpha, C beta) {
  switch (op) {
    case UnaryOp::neg: return -x;
    case UnaryOp::exp: return m_exp(x);
    case UnaryOp::log: return m_log(x);
    case UnaryOp::sqrt: return m_sqrt(x);
    case UnaryOp::rsqrt: return C(1) / m_sqrt(x);  // not rsqrt(): its 2-ulp error would differ from the CPU
    case UnaryOp::tanh: return m_tanh(x);
    case UnaryOp::sigmoid: return C(1) / (C(1) + m_exp(-x));
    case UnaryOp::relu: return x > C(0) ? x : (x == x ? C(0) : x);  // NaN stays NaN
    case UnaryOp::gelu_tanh: return gelu_tanh_value(x);
    case UnaryOp::gelu_erf: return gelu_erf_value(x);
    case UnaryOp::abs: return m_abs(x);
    case UnaryOp::sin: return m_sin(x);
    case UnaryOp::cos: return m_cos(x);
    case UnaryOp::square: return x * x;
    case UnaryOp::reciprocal: return C(1) / x;
    case UnaryOp::affine: return x * alpha + beta;
    case UnaryOp::pow_scalar: return m_pow(x, alpha);
    case UnaryOp::step: return x > C(0) ? C(1) : C(0);
  }
  return x;
}

template <typename C>
__device__ __forceinline__ C binary_value(BinaryOp op, C a, C b) {
  switch (op) {
    case BinaryOp::add: return a + b;
    case BinaryOp::sub: return a - b;
    case BinaryOp::mul: return a * b;
    case BinaryOp::div: return a / b;
    case BinaryOp::pow: return m_pow(a, b);
    // NaN in either operand gives NaN, as in PyTorch.
    case BinaryOp::maximum: return (a != a || a > b) ? a : b;
    case BinaryOp::minimum: return (a != a || a < b) ? a : b;
    case BinaryOp::eq: return C(a == b);
    case BinaryOp::ne: return C(a != b);
    case BinaryOp::lt: return C(a < b);
    case BinaryOp::le: return C(a <= b);
    case BinaryOp::gt: return C(a > b);
    case BinaryOp::ge: return C(a >= b);
    case BinaryOp::relu_backward: return b > C(0) ? a : C(0);
    case BinaryOp::gelu_tanh_backward: return a * gelu_tanh_grad(b);
    case BinaryOp::gelu_erf_backward: return a * gelu_erf_grad(b);
    case BinaryOp::tanh_backward: return a * (C(1) - b * b);
    case BinaryOp::sigmoid_backward: return a * b * (C(1) - b);
  }
  return a;
}

template <typename T, int V>
__device__ __forceinline__ Pack<T, V> splat(T x) {
  Pack<T, V> p;
#pragma unroll
  for (int j = 0; j < V; ++j) p.v[j] = x;
  return p;
}

// The V elements of an input at `p` for V consecutive outputs: a 16-byte
// pack where its inner stride is 1, else its one element repeated (a
// broadcast input).
template <typename T, int V>
__device__ __forceinline__ Pack<T, V> pack_at(const T* p, int64_t inner_stride) {
  return inner_stride == 1 ? *reinterpret_cast<const Pack<T, V>*>(p) : splat<T, V>(*p);
}

// out = f(inputs...) over N - 1 inputs in any Layout; f works in the compute type.
template <typename T, int N, typename F>
__device__ __forceinline__ void elementwise(const Strided<N>& s, int64_t n, Layout layout, F f) {
  using E = Element<T>;
  using C = typename E::Compute;
  constexpr int M = N - 1;
  constexpr int V = 16 / sizeof(T);
  using P = Pack<T, V>;
  T* out = static_cast<T*>(s.data[0]);
  const T* in[M];
#pragma unroll
  for (int k = 0; k < M; ++k) in[k] = static_cast<const T*>(s.data[k + 1]);
  auto apply = [&](const C (&x)[M]) {
    if constexpr (M == 1) return f(x[0]);
    else return f(x[0], x[1]);
  };
  // One Pack of inputs -> one Pack of output.
  auto apply_pack = [&](const P (&x)[M]) {
    P y;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      C a[M];
#pragma unroll
      for (int k = 0; k < M; ++k) a[k] = E::load(x[k].v[j]);
      y.v[j] = E::store(apply(a));
    }
    return y;
  };

  if (layout == Layout::strided) {
    for_each_strided(s, n, 1, [&](const int64_t (&off)[N]) {
      C a[M];
#pragma unroll
      for (int k = 0; k < M; ++k) a[k] = E::load(in[k][off[k + 1]]);
      out[off[0]] = E::store(apply(a));
    });
    return;
  }
  // Layout::packed
  for_each_strided(s, n / V, V, [&](const int64_t (&off)[N]) {
    P x[M];
#pragma unroll
    for (int k = 0; k < M; ++k)
      x[k] = pack_at<T, V>(in[k] + off[k + 1], s.strides[k + 1][0]);
    *reinterpret_cast<P*>(out + off[0]) = apply_pack(x);
  });
  // The last n % V elements (one dimension only; else there are none).
  for (int64_t i = n / V * V + global_thread(); i < n; i += grid_threads()) {
    C a[M];
#pragma unroll
    for (int k = 0; k < M; ++k) a[k] = E::load(in[k][i * s.strides[k + 1][0]]);
    out[i] = E::store(apply(a));
  }
}

// The costliest ops of a training step (GELU each way, ReLU's backward)
// get their own copy of the loop with the op fixed at compile time, so no
// element pays the dispatch; the rest share one loop that switches per
// element.
template <typename T>
__global__ void unary_kernel(UnaryOp op, Strided<2> s, int64_t n, typename Element<T>::Compute alpha,
                             typename Element<T>::Compute beta, Layout layout) {
  using C = typename Element<T>::Compute;
  switch (op) {
    case UnaryOp::gelu_erf:
      return elementwise<T>(s, n, layout, [](C x) { return unary_value(UnaryOp::gelu_erf, x, C(0), C(0)); });
    case UnaryOp::gelu_tanh:
      return elementwise<T>(s, n, layout, [](C x) { return unary_value(UnaryOp::gelu_tanh, x, C(0), C(0)); });
    default: return elementwise<T>(s, n, layout, [&](C x) { return unary_value(op, x, alpha, beta); });
  }
}

template <typename T>
__global__ void binary_kernel(BinaryOp op, Strided<3> s, int64_t n, Layout layout) {
  using C = typename Element<T>::Compute;
  switch (op) {
    case BinaryOp::gelu_erf_backward:
      return elementwise<T>(s, n, layout, [](C a, C b) { return binary_value(BinaryOp::gelu_erf_backward, a, b); });
    case BinaryOp::gelu_tanh_backward:
      return elementwise<T>(s, n, layout, [](C a, C b) { return binary_value(BinaryOp::gelu_tanh_backward, a, b); });
    case BinaryOp::relu_backward:
      return elementwise<T>(s, n, layout, [](C a, C b) { return binary_value(BinaryOp::relu_backward, a, b); });
    default: return elementwise<T>(s, n, layout, [&](C a, C b) { return binary_value(op, a, b); });
  }
}

// out (f32) = op(a, b) where one input is f32 and the other 16-bit (a
// residual stream's x plus a 16-bit branch under autocast): the narrow
// input is widened as it is loaded, as type promotion does in PyTorch's
// kernels, rather than by a cast pass first (which writes and reads the
// widened copy). Packs of four: 16 bytes of f32, 8 of the 16-bit input.
template <typename TA, typename TB>
__global__ void binary_wide_kernel(BinaryOp op, Strided<3> s, int64_t n, Layout layout) {
  constexpr int V = 4;
  float* out = static_cast<float*>(s.data[0]);
  const TA* a = static_cast<const TA*>(s.data[1]);
  const TB* b = static_cast<const TB*>(s.data[2]);
  auto value = [op](TA x, TB y) { return binary_value(op, Element<TA>::load(x), Element<TB>::load(y)); };
  if (layout == Layout::strided) {
    for_each_strided(s, n, 1, [&](const int64_t (&off)[3]) { out[off[0]] = value(a[off[1]], b[off[2]]); });
    return;
  }
  for_each_strided(s, n / V, V, [&](const int64_t (&off)[3]) {
    const Pack<TA, V> x = pack_at<TA, V>(a + off[1], s.strides[1][0]);
    const Pack<TB, V> y = pack_at<TB, V>(b + off[2], s.strides[2][0]);
    Pack<float, V> z;
#pragma unroll
    for (int j = 0; j < V; ++j) z.v[j] = value(x.v[j], y.v[j]);
    *reinterpret_cast<Pack<float, V>*>(out + off[0]) = z;
  });
  for (int64_t i = n / V * V + global_thread(); i < n; i += grid_threads())
    out[i] = value(a[i * s.strides[1][0]], b[i * s.strides[2][0]]);
}

template <typename TA, typename TB>
void binary_wide_typed(const Launch& l, BinaryOp op, const Strided<3>& s, int64_t n) {
  const Layout layout = choose_layout(s, sizeof(float));
  binary_wide_kernel<TA, TB><<<grid_for(l, layout_work(layout, n, sizeof(float))), kThreads, 0, l.stream>>>(
      op, s, n, layout);
  MPT_CUDA_CHECK_LAUNCH("binary_wide_kernel");
}

template <typename T>
void unary_typed(const Launch& l, UnaryOp op, const Strided<2>& s, int64_t n, double alpha, double beta) {
  using C = typename Element<T>::Compute;
  const Layout layout = choose_layout(s, sizeof(T));
  unary_kernel<T><<<grid_for(l, layout_work(layout, n, sizeof(T))), kThreads, 0, l.stream>>>(
      op, s, n, static_cast<C>(alpha), static_cast<C>(beta), layout);
  MPT_CUDA_CHECK_LAUNCH("unary_kernel");
}

template <typename T>
void binary_typed(const Launch& l, BinaryOp op, const Strided<3>& s, int64_t n) {
  const Layout layout = choose_layout(s, sizeof(T));
  binary_kernel<T><<<grid_for(l, layout_work(layout, n, sizeof(T))), kThreads, 0, l.stream>>>(op, s, n, layout);
  MPT_CUDA_CHECK_LAUNCH("binary_kernel");
}

}  // namespace

void launch_unary(const Launch& l, UnaryOp op, DType dtype, const Strided<2>& s, int64_t n, double alpha,
                  double beta) {
  dispatch_floating(dtype, "unary",
                    [&](auto tag) { unary_typed<decltype(tag)>(l, op, s, n, alpha, beta); });
}

void launch_binary(const Launch& l, BinaryOp op, DType dtype, const Strided<3>& s, int64_t n) {
  dispatch_floating(dtype, "binary", [&](auto tag) { binary_typed<decltype(tag)>(l, op, s, n); });
}

bool binary_wide_supported(DType out, DType a, DType b) {
  auto narrow = [](DType t) { return t == DType::f16 || t == DType::bf16; };
  return out == DType::f32 && ((a == DType::f32 && narrow(b)) || (narrow(a) && b == DType::f32));
}

void launch_binary_wide(const Launch& l, BinaryOp op, DType a, DType b, const Strided<3>& s, int64_t n) {
  if (a == DType::f32 && b == DType::f16) return binary_wide_typed<float, __half>(l, op, s, n);
  if (a == DType::f32 && b == DType::bf16) return binary_wide_typed<float, __nv_bfloat16>(l, op, s, n);
  if (a == DType::f16 && b == DType::f32) return binary_wide_typed<__half, float>(l, op, s, n);
  if (a == DType::bf16 && b == DType::f32) return binary_wide_typed<__nv_bfloat16, float>(l, op, s, n);
  throw_dtype_unsupported("binary (f32 with a 16-bit input)", a == DType::f32 ? b : a);
}

}  // namespace mpt::cuda
