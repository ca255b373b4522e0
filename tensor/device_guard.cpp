#include "tensor/device_guard.h"

#ifdef MPT_WITH_CUDA
#include <cuda_runtime.h>

#include "tensor/cuda/check.h"
#endif

namespace mpt {

DeviceGuard::DeviceGuard(const Device& d) {
#ifdef MPT_WITH_CUDA
  if (!d.is_cuda()) return;
  int current = 0;
  MPT_CUDA_CHECK(cudaGetDevice(&current));
  if (current == d.index) return;
  MPT_CUDA_CHECK(cudaSetDevice(d.index));
  previous_ = current;
#else
  (void)d;
#endif
}

DeviceGuard::~DeviceGuard() {
#ifdef MPT_WITH_CUDA
  // A destructor must not throw; a failure must not linger as the runtime's
  // last error either, or the next launch check would report it.
  if (previous_ >= 0 && cudaSetDevice(previous_) != cudaSuccess) (void)cudaGetLastError();
#endif
}

}  // namespace mpt
