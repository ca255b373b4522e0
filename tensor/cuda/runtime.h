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
// Streaming multiprocessors of `device`, cached.
int multiprocessor_count(int device);

}  // namespace mpt::cuda
