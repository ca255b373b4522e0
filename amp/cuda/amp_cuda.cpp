// amp's CUDA entry points: tensors in, plain pointers out to the launchers
// (amp/cuda/unscale.cu), on the current stream of the tensors' device.
#include "amp/amp_cuda.h"

#include "amp/cuda/fp8_scaling_kernels.h"
#include "amp/cuda/unscale_kernels.h"
#include "tensor/cuda/runtime.h"
#include "tensor/device_guard.h"

namespace mpt::amp::cuda {

void unscale_and_check_inf(const std::vector<Tensor>& grads, Tensor& found_inf, const Tensor& inv_scale) {
  const Device device = found_inf.device();
  DeviceGuard guard(device);
  cudaStream_t stream = mpt::cuda::current_cuda_stream(device.index);
  // One launch (or a few, for long lists) per gradient dtype.
  for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    std::vector<void*> pointers;
    std::vector<int64_t> sizes;
    for (const Tensor& g : grads)
      if (g.dtype() == dtype) {
        pointers.push_back(g.data_ptr());
        sizes.push_back(g.numel());
      }
    if (pointers.empty()) continue;
    launch_unscale_and_check_inf(dtype, pointers.data(), sizes.data(), pointers.size(), found_inf.data<float>(),
                                 inv_scale.defined() ? inv_scale.data<float>() : nullptr, stream);
  }
}

void update_scale(Tensor& scale, Tensor& growth_tracker, Tensor& hysteresis_left, const Tensor& found_inf,
                  const ScaleRule& rule, int64_t units) {
  const Device device = scale.device();
  DeviceGuard guard(device);
  launch_update_scale(scale.data<float>(), growth_tracker.data<int64_t>(), hysteresis_left.data<int32_t>(),
                      found_inf.data<float>(), rule, units, mpt::cuda::current_cuda_stream(device.index));
}

void fp8_delayed_update(Tensor& amax, Tensor& history, Tensor& recorded, Tensor& scale,
                        const DelayedScalingRule& rule) {
  const Device device = amax.device();
  DeviceGuard guard(device);
  launch_fp8_delayed_update(amax.data<float>(), history.data<float>(), recorded.data<int64_t>(), scale.data<float>(),
                            amax.numel(), rule, mpt::cuda::current_cuda_stream(device.index));
}

void fp8_current_scale(const Tensor& amax, Tensor& scale, float target_max) {
  const Device device = amax.device();
  DeviceGuard guard(device);
  launch_fp8_current_scale(amax.data<float>(), scale.data<float>(), target_max,
                           mpt::cuda::current_cuda_stream(device.index));
}

}  // namespace mpt::amp::cuda
