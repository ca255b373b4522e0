// The FP8 recipes' per-step rules on the GPU (amp/fp8_scale_rule.h, the
// same functions the CPU runs): a warp per tensor, so scales and
// histories never leave the device and a captured step replays them.
#include "amp/cuda/fp8_scaling_kernels.h"
#include "tensor/cuda/check.h"

namespace mpt::amp::cuda {
namespace {

// A warp per tensor: the lanes share the history's max reduction (a
// thread reading 1024 entries in turn took 50 us a launch on an H100).
constexpr int kWarpsPerBlock = 4;

__global__ void delayed_update_kernel(float* amax, float* history, int64_t* recorded, float* scale, int64_t slots,
                                      DelayedScalingRule rule) {
  const int64_t s = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (s >= slots) return;  // the whole warp
  const float a = amax[s];
  if (!fp8_amax_recordable(a)) {
    if (lane == 0) amax[s] = 0.0f;
    return;
  }
  const DelayedScalingState state{history + s * rule.history_length, recorded + s, scale + s};
  float others_max = a;
  if (rule.reduction == AmaxReduction::max) {
    others_max = fp8_history_max(state.history, rule.history_length, lane, 32, *state.recorded % rule.history_length, a);
    for (int offset = 16; offset > 0; offset /= 2) {
      const float other = __shfl_down_sync(0xffffffffu, others_max, offset);
      others_max = other > others_max ? other : others_max;
    }
  }
  if (lane == 0) {
    record_delayed_amax(rule, a, others_max, state);
    amax[s] = 0.0f;
  }
}

__global__ void current_scale_kernel(const float* amax, float* scale, float target_max) {
  *scale = fp8_current_scale(*amax, target_max);
}

}  // namespace

void launch_fp8_delayed_update(float* amax, float* history, int64_t* recorded, float* scale, int64_t slots,
                               const DelayedScalingRule& rule, cudaStream_t stream) {
  if (slots == 0) return;
  delayed_update_kernel<<<static_cast<unsigned>((slots + kWarpsPerBlock - 1) / kWarpsPerBlock), kWarpsPerBlock * 32, 0,
                          stream>>>(
      amax, history, recorded, scale, slots, rule);
  MPT_CUDA_CHECK_LAUNCH("fp8 delayed_update_kernel");
}

void launch_fp8_current_scale(const float* amax, float* scale, float target_max, cudaStream_t stream) {
  current_scale_kernel<<<1, 1, 0, stream>>>(amax, scale, target_max);
  MPT_CUDA_CHECK_LAUNCH("fp8 current_scale_kernel");
}

}  // namespace mpt::amp::cuda
