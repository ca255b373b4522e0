#pragma once
// The CUDA side of amp/ (amp/cuda/*.cu; amp/cuda_stubs.cpp in builds without
// CUDA). Callers check operands first; these only launch.
#include <vector>

#include "amp/fp8_scale_rule.h"
#include "amp/scale_rule.h"
#include "tensor/tensor.h"

namespace mpt::amp::cuda {

// inv_scale undefined: the check alone.
void unscale_and_check_inf(const std::vector<Tensor>& grads, Tensor& found_inf, const Tensor& inv_scale);

// One thread applies update_scale (amp/scale_rule.h) to the state tensors,
// so the scale never leaves the GPU.
void update_scale(Tensor& scale, Tensor& growth_tracker, Tensor& hysteresis_left, const Tensor& found_inf,
                  const ScaleRule& rule, int64_t units);

// FP8 (amp/fp8_scaling.h): delayed scaling's step for every slot of a
// group (amax [S], history [S, H], recorded i64 [S], scale [S]; amax set to
// 0 after), and current scaling's scale from an amax (f32 [1] each).
void fp8_delayed_update(Tensor& amax, Tensor& history, Tensor& recorded, Tensor& scale,
                        const DelayedScalingRule& rule);
void fp8_current_scale(const Tensor& amax, Tensor& scale, float target_max);

}  // namespace mpt::amp::cuda
