#pragma once
// GELU's formulas on the GPU, each way, in the compute type C: those of
// tensor/cpu/cpu_elementwise.cpp, written the same way. Shared by the
// element-wise kernels (elementwise.cu) and the FP8 quantization that
// folds GELU in (fp8_quantize.cu), so that both give the same bits; both
// files build with --fmad=false, as the CPU builds with -ffp-contract=off.
namespace mpt::cuda {

// The precise (not the fast-math) CUDA functions, by argument type.
__device__ __forceinline__ float m_exp(float x) { return expf(x); }
__device__ __forceinline__ double m_exp(double x) { return exp(x); }
__device__ __forceinline__ float m_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double m_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float m_erf(float x) { return erff(x); }
__device__ __forceinline__ double m_erf(double x) { return erf(x); }

constexpr double kSqrt2OverPi = 0.79788456080286535588;  // sqrt(2 / pi)
constexpr double kGeluCubic = 0.044715;
constexpr double kInvSqrt2 = 0.70710678118654752440;     // 1 / sqrt(2)
constexpr double kInvSqrt2Pi = 0.39894228040143267794;   // 1 / sqrt(2 pi)

// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
template <typename C>
__device__ __forceinline__ C gelu_tanh_value(C x) {
  return C(0.5) * x * (C(1) + m_tanh(C(kSqrt2OverPi) * (x + C(kGeluCubic) * x * x * x)));
}

// x Phi(x) = 0.5 x (1 + erf(x / sqrt(2))).
template <typename C>
__device__ __forceinline__ C gelu_erf_value(C x) {
  return C(0.5) * x * (C(1) + m_erf(x * C(kInvSqrt2)));
}

// d/dx of 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3).
template <typename C>
__device__ __forceinline__ C gelu_tanh_grad(C x) {
  const C x2 = x * x;
  const C t = m_tanh(C(kSqrt2OverPi) * (x + C(kGeluCubic) * x2 * x));
  const C du = C(kSqrt2OverPi) * (C(1) + C(3 * kGeluCubic) * x2);
  return C(0.5) * (C(1) + t) + C(0.5) * x * (C(1) - t * t) * du;
}

// d/dx of x Phi(x) = Phi(x) + x phi(x).
template <typename C>
__device__ __forceinline__ C gelu_erf_grad(C x) {
  return C(0.5) * (C(1) + m_erf(x * C(kInvSqrt2))) + x * m_exp(C(-0.5) * x * x) * C(kInvSqrt2Pi);
}

}  // namespace mpt::cuda
