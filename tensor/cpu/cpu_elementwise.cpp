// Element-wise unary and binary kernels on the CPU. Each op is a small
// functor; the strided loop is shared. 16-bit floats compute in f32. Dense
// operands of many elements are split over the backend's threads.
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "tensor/cpu/cpu_kernels.h"
#include "tensor/cpu/cpu_threads.h"
#include "tensor/cpu/fast_math.h"

namespace mpt::cpu {
namespace {

constexpr double kSqrt2OverPi = 0.7978845608028654;
constexpr double kGeluCoeff = 0.044715;
constexpr double kInvSqrt2 = 0.7071067811865476;
constexpr double kInvSqrt2Pi = 0.3989422804014327;

template <typename C>
C gelu_tanh(C x) {
  const C u = static_cast<C>(kSqrt2OverPi) * (x + static_cast<C>(kGeluCoeff) * x * x * x);
  return static_cast<C>(0.5) * x * (static_cast<C>(1) + std::tanh(u));
}
template <typename C>
C gelu_tanh_grad(C x) {
  const C u = static_cast<C>(kSqrt2OverPi) * (x + static_cast<C>(kGeluCoeff) * x * x * x);
  const C t = std::tanh(u);
  const C du = static_cast<C>(kSqrt2OverPi) * (static_cast<C>(1) + static_cast<C>(3 * kGeluCoeff) * x * x);
  return static_cast<C>(0.5) * (static_cast<C>(1) + t) + static_cast<C>(0.5) * x * (static_cast<C>(1) - t * t) * du;
}
// GELU's 1 + erf(x / sqrt 2) and exp(-x^2 / 2): in f32 by fast_math.h's
// loops, which vectorise (libm's erff and expf were most of a transformer's
// element-wise time on the CPU); in f64 by libm, for the gradient checks.
template <typename C>
[[gnu::always_inline]] inline C gelu_one_plus_erf(C x) {
  if constexpr (std::is_same_v<C, float>) return one_plus_erf_f32(x * static_cast<float>(kInvSqrt2));
  else return static_cast<C>(1) + std::erf(x * static_cast<C>(kInvSqrt2));
}
template <typename C>
[[gnu::always_inline]] inline C gelu_gaussian(C x) {
  if constexpr (std::is_same_v<C, float>) return exp_f32(-0.5f * x * x);
  else return std::exp(static_cast<C>(-0.5) * x * x);
}
template <typename C>
[[gnu::always_inline]] inline C gelu_erf(C x) {
  return static_cast<C>(0.5) * x * gelu_one_plus_erf(x);
}
template <typename C>
[[gnu::always_inline]] inline C gelu_erf_grad(C x) {
  return static_cast<C>(0.5) * gelu_one_plus_erf(x) + x * gelu_gaussian(x) * static_cast<C>(kInvSqrt2Pi);
}

// GELU of a 16-bit input is a function of its 65536 bit patterns: tables
// of the f32 rule's rounded result (forward) and of its f32 derivative
// (backward, still multiplied by the gradient in f32), made once per dtype
// and form by the very functions the loops call, so a lookup gives the
// bits the computation would (the build has no contraction,
// -ffp-contract=off). A lookup costs a few cycles where erf's polynomial
// and exponentials cost tens (bench_cpu_attention's gelu).
template <typename T>
struct GeluTables {
  std::vector<uint16_t> value;  // bits of gelu(x) in T
  std::vector<float> slope;     // gelu'(x) in f32
};

template <typename T, bool kTanh>
const GeluTables<T>& gelu_tables() {
  static const GeluTables<T> tables = [] {
    GeluTables<T> t;
    t.value.resize(size_t{1} << 16);
    t.slope.resize(size_t{1} << 16);
    for (uint32_t bits = 0; bits < (uint32_t{1} << 16); ++bits) {
      const T x = T::from_bits(static_cast<uint16_t>(bits));
      const float xf = load<T, float>(&x);
      T y;
      store<T, float>(&y, kTanh ? gelu_tanh(xf) : gelu_erf(xf));
      t.value[bits] = y.bits;
      t.slope[bits] = kTanh ? gelu_tanh_grad(xf) : gelu_erf_grad(xf);
    }
    return t;
  }();
  return tables;
}

// Dense 16-bit GELU through the tables; false (nothing done) for other
// dtypes, ops or layouts.
template <typename T>
bool gelu_by_table(UnaryOp op, const TensorView& out, const TensorView& in) {
  if constexpr (!std::is_same_v<T, BFloat16> && !std::is_same_v<T, Half>) {
    return false;
  } else {
    if ((op != UnaryOp::gelu_erf && op != UnaryOp::gelu_tanh) || !out.is_contiguous() || !in.is_contiguous())
      return false;
    const uint16_t* table = (op == UnaryOp::gelu_tanh ? gelu_tables<T, true>() : gelu_tables<T, false>()).value.data();
    auto* o = static_cast<T*>(out.data);
    const auto* x = static_cast<const T*>(in.data);
    parallel_for_elements(out.numel(), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) o[i].bits = table[x[i].bits];
    });
    return true;
  }
}

// The same for the backward ops, out = grad * gelu'(x) rounded once.
template <typename T>
bool gelu_backward_by_table(BinaryOp op, const TensorView& out, const TensorView& grad, const TensorView& in) {
  if constexpr (!std::is_same_v<T, BFloat16> && !std::is_same_v<T, Half>) {
    return false;
  } else {
    if ((op != BinaryOp::gelu_erf_backward && op != BinaryOp::gelu_tanh_backward) || !out.is_contiguous() ||
        !grad.is_contiguous() || !in.is_contiguous())
      return false;
    const float* slope =
        (op == BinaryOp::gelu_tanh_backward ? gelu_tables<T, true>() : gelu_tables<T, false>()).slope.data();
    auto* o = static_cast<T*>(out.data);
    const auto* g = static_cast<const T*>(grad.data);
    const auto* x = static_cast<const T*>(in.data);
    parallel_for_elements(out.numel(), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) store<T, float>(o + i, load<T, float>(g + i) * slope[x[i].bits]);
    });
    return true;
  }
}

// The rows' loops, with the common strides spelled out as constants so
// that the compiler vectorizes them: every operand dense, or one operand
// a single value broadcast along the row (a bias, a scale).
template <typename T, typename F>
void unary_loop(const TensorView& out, const TensorView& in, F f) {
  using C = typename ComputeType<T>::type;
  auto* o = static_cast<T*>(out.data);
  const auto* x = static_cast<const T*>(in.data);
  if (out.is_contiguous() && in.is_contiguous())
    return parallel_for_elements(out.numel(), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) store<T, C>(o + i, f(load<T, C>(x + i)));
    });
  for_each_row<2>(out, {out.strides, in.strides}, [&](auto off, int64_t n, auto st) {
    T* po = o + off[0];
    const T* px = x + off[1];
    if (st[0] == 1 && st[1] == 1) {
      for (int64_t i = 0; i < n; ++i) store<T, C>(po + i, f(load<T, C>(px + i)));
    } else {
      for (int64_t i = 0; i < n; ++i) store<T, C>(po + i * st[0], f(load<T, C>(px + i * st[1])));
    }
  });
}

template <typename T, typename F>
void binary_loop(const TensorView& out, const TensorView& a, const TensorView& b, F f) {
  using C = typename ComputeType<T>::type;
  auto* o = static_cast<T*>(out.data);
  const auto* pa = static_cast<const T*>(a.data);
  const auto* pb = static_cast<const T*>(b.data);
  if (out.is_contiguous() && a.is_contiguous() && b.is_contiguous())
    return parallel_for_elements(out.numel(), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) store<T, C>(o + i, f(load<T, C>(pa + i), load<T, C>(pb + i)));
    });
  for_each_row<3>(out, {out.strides, a.strides, b.strides}, [&](auto off, int64_t n, auto st) {
    T* po = o + off[0];
    const T* x = pa + off[1];
    const T* y = pb + off[2];
    if (st[0] == 1 && st[1] == 1 && st[2] == 1) {
      for (int64_t i = 0; i < n; ++i) store<T, C>(po + i, f(load<T, C>(x + i), load<T, C>(y + i)));
    } else if (st[0] == 1 && st[1] == 1 && st[2] == 0) {
      const C yv = load<T, C>(y);
      for (int64_t i = 0; i < n; ++i) store<T, C>(po + i, f(load<T, C>(x + i), yv));
    } else if (st[0] == 1 && st[1] == 0 && st[2] == 1) {
      const C xv = load<T, C>(x);
      for (int64_t i = 0; i < n; ++i) store<T, C>(po + i, f(xv, load<T, C>(y + i)));
    } else {
      for (int64_t i = 0; i < n; ++i)
        store<T, C>(po + i * st[0], f(load<T, C>(x + i * st[1]), load<T, C>(y + i * st[2])));
    }
  });
}

}  // namespace

void unary(UnaryOp op, const TensorView& out, const TensorView& in, double alpha, double beta) {
  dispatch_float(out.dtype, unary_op_name(op), [&](auto tag) {
    using T = decltype(tag);
    using C = typename ComputeType<T>::type;
    const C a = static_cast<C>(alpha), b = static_cast<C>(beta);
    if (gelu_by_table<T>(op, out, in)) return;
    auto run = [&](auto f) { unary_loop<T>(out, in, f); };
    switch (op) {
      case UnaryOp::neg: return run([](C x) { return -x; });
      case UnaryOp::exp: return run([](C x) { return std::exp(x); });
      case UnaryOp::log: return run([](C x) { return std::log(x); });
      case UnaryOp::sqrt: return run([](C x) { return std::sqrt(x); });
      case UnaryOp::rsqrt: return run([](C x) { return static_cast<C>(1) / std::sqrt(x); });
      case UnaryOp::tanh: return run([](C x) { return std::tanh(x); });
      case UnaryOp::sigmoid: return run([](C x) { return static_cast<C>(1) / (static_cast<C>(1) + std::exp(-x)); });
      case UnaryOp::relu: return run([](C x) { return x > 0 ? x : (x == x ? static_cast<C>(0) : x); });
      case UnaryOp::gelu_tanh: return run([](C x) { return gelu_tanh(x); });
      case UnaryOp::gelu_erf: return run([](C x) { return gelu_erf(x); });
      case UnaryOp::abs: return run([](C x) { return std::fabs(x); });
      case UnaryOp::sin: return run([](C x) { return std::sin(x); });
      case UnaryOp::cos: return run([](C x) { return std::cos(x); });
      case UnaryOp::square: return run([](C x) { return x * x; });
      case UnaryOp::reciprocal: return run([](C x) { return static_cast<C>(1) / x; });
      case UnaryOp::affine: return run([=](C x) { return x * a + b; });
      case UnaryOp::pow_scalar: return run([=](C x) { return std::pow(x, a); });
      case UnaryOp::step: return run([](C x) { return x > 0 ? static_cast<C>(1) : static_cast<C>(0); });
    }
  });
}

void binary(BinaryOp op, const TensorView& out, const TensorView& a, const TensorView& b) {
  dispatch_float(out.dtype, binary_op_name(op), [&](auto tag) {
    using T = decltype(tag);
    using C = typename ComputeType<T>::type;
    constexpr C one = 1, zero = 0;
    if (gelu_backward_by_table<T>(op, out, a, b)) return;
    auto run = [&](auto f) { binary_loop<T>(out, a, b, f); };
    switch (op) {
      case BinaryOp::add: return run([](C x, C y) { return x + y; });
      case BinaryOp::sub: return run([](C x, C y) { return x - y; });
      case BinaryOp::mul: return run([](C x, C y) { return x * y; });
      case BinaryOp::div: return run([](C x, C y) { return x / y; });
      case BinaryOp::pow: return run([](C x, C y) { return std::pow(x, y); });
      // NaN propagates, as torch.maximum / torch.minimum do.
      case BinaryOp::maximum: return run([](C x, C y) { return (x != x || x > y) ? x : y; });
      case BinaryOp::minimum: return run([](C x, C y) { return (x != x || x < y) ? x : y; });
      case BinaryOp::eq: return run([](C x, C y) { return x == y ? one : zero; });
      case BinaryOp::ne: return run([](C x, C y) { return x != y ? one : zero; });
      case BinaryOp::lt: return run([](C x, C y) { return x < y ? one : zero; });
      case BinaryOp::le: return run([](C x, C y) { return x <= y ? one : zero; });
      case BinaryOp::gt: return run([](C x, C y) { return x > y ? one : zero; });
      case BinaryOp::ge: return run([](C x, C y) { return x >= y ? one : zero; });
      case BinaryOp::relu_backward: return run([](C g, C x) { return x > 0 ? g : zero; });
      case BinaryOp::gelu_tanh_backward: return run([](C g, C x) { return g * gelu_tanh_grad(x); });
      case BinaryOp::gelu_erf_backward: return run([](C g, C x) { return g * gelu_erf_grad(x); });
      case BinaryOp::tanh_backward: return run([](C g, C y) { return g * (one - y * y); });
      case BinaryOp::sigmoid_backward: return run([](C g, C y) { return g * y * (one - y); });
    }
  });
}

}  // namespace mpt::cpu
