// The FP8 recipes' per-step rules on the GPU (amp/fp8_scale_rule.h, the
// same functions the CPU runs): a thread per tensor, so scales and
// histories never leave the device and a captured step replays them.
#include "amp/cuda/fp8_scaling_kernels.h"
#include "tensor/cuda/check.h"

namespace mpt::amp::cuda {
namespace {

__global__ void delayed_update_kernel(float* amax, float* history, int64_t* recorded, float* scale, int64_t slots,
                                      DelayedScalingRule rule) {
  const int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (s >= slots) return;
  update_delayed_scaling(rule, amax[s], {history + s * rule.history_length, recorded + s, scale + s});
  amax[s] = 0.0f;
}

__global__ void current_scale_kernel(const float* amax, float* scale, float target_max) {
  *scale = fp8_current_scale(*amax, target_max);
}

}  // namespace

void launch_fp8_delayed_update(float* amax, float* history, int64_t* recorded, float* scale, int64_t slots,
                               const DelayedScalingRule& rule, cudaStream_t stream) {
  if (slots == 0) return;
  constexpr int kThreads = 128;
  delayed_update_kernel<<<static_cast<unsigned>((slots + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      amax, history, recorded, scale, slots, rule);
  MPT_CUDA_CHECK_LAUNCH("fp8 delayed_update_kernel");
}

void launch_fp8_current_scale(const float* amax, float* scale, float target_max, cudaStream_t stream) {
  current_scale_kernel<<<1, 1, 0, stream>>>(amax, scale, target_max);
  MPT_CUDA_CHECK_LAUNCH("fp8 current_scale_kernel");
}

}  // namespace mpt::amp::cuda
