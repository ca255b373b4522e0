#pragma once
// Parameter initialisation, matching PyTorch's defaults in distribution.
// Every initialiser draws from an explicit Generator (the thread's default
// when null), so a model built after manual_seed(s) is the same every run.
#include <cmath>

#include "tensor/ops.h"

namespace mpt::nn::init {

// U(-bound, bound), f32.
inline Tensor uniform(const Shape& shape, double bound, Generator* gen) {
  return rand(shape, DType::f32, kCPU, gen, -bound, bound);
}

// N(0, 1), f32.
inline Tensor normal(const Shape& shape, Generator* gen) { return randn(shape, DType::f32, kCPU, gen); }

// PyTorch's Linear/Conv default, kaiming_uniform_(a=sqrt(5)):
// gain = sqrt(2 / (1 + a^2)) = 1/sqrt(3), bound = gain * sqrt(3 / fan_in)
// = 1/sqrt(fan_in). The bias uses the same bound.
inline double fan_in_bound(int64_t fan_in) { return fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0; }

}  // namespace mpt::nn::init
