#pragma once
// The CUDA side of amp/ (amp/cuda/*.cu; amp/cuda_stubs.cpp in builds without
// CUDA). Callers check operands first; these only launch.
#include <vector>

#include "amp/scale_rule.h"
#include "tensor/tensor.h"

namespace mpt::amp::cuda {

// inv_scale undefined: the check alone.
void unscale_and_check_inf(const std::vector<Tensor>& grads, Tensor& found_inf, const Tensor& inv_scale);

// One thread applies update_scale (amp/scale_rule.h) to the state tensors,
// so the scale never leaves the GPU.
void update_scale(Tensor& scale, Tensor& growth_tracker, Tensor& hysteresis_left, const Tensor& found_inf,
                  const ScaleRule& rule, int64_t units);

}  // namespace mpt::amp::cuda
