#pragma once
// The CUDA implementation of mpt::Backend. It works on the current CUDA
// device and that device's current stream: callers make the tensors' device
// current first (DeviceGuard, tensor/device_guard.h), since a TensorView
// carries no device.
#include "tensor/backend.h"

namespace mpt {

Backend& cuda_backend();

}  // namespace mpt
