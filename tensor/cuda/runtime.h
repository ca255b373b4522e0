#pragma once
// Internal helpers of the CUDA runtime layer (tensor/cuda/runtime.cpp).
#include <cuda_runtime.h>

#include "tensor/device.h"

namespace mpt::cuda {

inline Device cuda_device(int index) { return Device(DeviceType::cuda, index); }

// cudaGetDevice, checked.
int current_device();

// This thread's current stream on the current CUDA device: where the backend
// launches everything (ops make the tensor's device current first).
cudaStream_t current_cuda_stream();
// This thread's current stream on `device` (a CUDA device).
cudaStream_t current_cuda_stream(int device);
// check_device_available, and that the kernels can run there (the compute
// capability: see cuda_info.h). Checked where a tensor first needs memory
// on the device, not by the diagnostics that describe it.
void check_device_usable(const Device& d);
// Streaming multiprocessors of `device`, cached.
int multiprocessor_count(int device);

}  // namespace mpt::cuda
