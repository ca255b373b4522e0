#include "tensor/cuda/cudnn_handle.h"

#include <array>

#include "tensor/cuda/check.h"
#include "tensor/cuda/runtime.h"
#include "tensor/error.h"

namespace mpt::cuda {

cudnnHandle_t cudnn_handle(int device) {
  thread_local std::array<cudnnHandle_t, 64> handles{};  // never destroyed: cheap to keep until exit
  check<DeviceError>(device >= 0 && device < static_cast<int>(handles.size()), "cuDNN: device index {} out of range",
                     device);
  if (!handles[device]) MPT_CUDNN_CHECK(cudnnCreate(&handles[device]));
  MPT_CUDNN_CHECK(cudnnSetStream(handles[device], current_cuda_stream(device)));
  return handles[device];
}

}  // namespace mpt::cuda
