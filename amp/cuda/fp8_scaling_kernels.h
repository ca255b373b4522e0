#pragma once
// Internal: launchers of amp/cuda/fp8_scaling.cu (plain pointers on the
// device, checked by the caller).
#include <cuda_runtime.h>

#include "amp/fp8_scale_rule.h"

namespace mpt::amp::cuda {

// For each of `slots` tensors: update_delayed_scaling with amax[s], then
// amax[s] = 0. history is [slots, rule.history_length].
void launch_fp8_delayed_update(float* amax, float* history, int64_t* recorded, float* scale, int64_t slots,
                               const DelayedScalingRule& rule, cudaStream_t stream);
// *scale = fp8_current_scale(*amax, target_max).
void launch_fp8_current_scale(const float* amax, float* scale, float target_max, cudaStream_t stream);

}  // namespace mpt::amp::cuda
