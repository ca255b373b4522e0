#pragma once
// Launchers for amp's kernels, on plain pointers: the .cu file stays free of
// Tensor (and so of fmt, which nvcc's C++20 mode cannot compile).
#include <cuda_runtime.h>

#include <cstdint>

#include "amp/scale_rule.h"
#include "tensor/dtype.h"

namespace mpt::amp::cuda {

// grads[i] holds sizes[i] contiguous elements of `dtype` (f32, f16 or bf16).
// inv_scale null: the check alone, the gradients left as they are.
void launch_unscale_and_check_inf(DType dtype, void* const* grads, const int64_t* sizes, size_t count,
                                  float* found_inf, const float* inv_scale, cudaStream_t stream);

void launch_update_scale(float* scale, int64_t* growth_tracker, int32_t* hysteresis_left, const float* found_inf,
                         const ScaleRule& rule, int64_t units, cudaStream_t stream);

}  // namespace mpt::amp::cuda
