// fill_slots' GPU entry point: tensors in, plain pointers out to the
// launcher (parallel/cuda/bucket_fill.cu).
#include "parallel/bucket_cuda.h"
#include "parallel/cuda/bucket_fill_kernels.h"
#include "tensor/cuda/runtime.h"
#include "tensor/device_guard.h"

namespace mpt::dist::cuda {

void scaled_copy_list(const std::vector<Tensor>& slots, const std::vector<Tensor>& grads, double scale) {
  if (slots.empty()) return;
  const Device device = slots.front().device();
  DeviceGuard guard(device);
  std::vector<const void*> srcs;
  std::vector<void*> dsts;
  std::vector<int64_t> sizes;
  for (size_t i = 0; i < slots.size(); ++i) {
    srcs.push_back(grads[i].data_ptr());
    dsts.push_back(slots[i].data_ptr());
    sizes.push_back(slots[i].numel());
  }
  launch_scaled_copy_list(grads.front().dtype(), slots.front().dtype(), srcs.data(), dsts.data(), sizes.data(),
                          sizes.size(), static_cast<float>(scale), mpt::cuda::current_cuda_stream(device.index));
}

}  // namespace mpt::dist::cuda
