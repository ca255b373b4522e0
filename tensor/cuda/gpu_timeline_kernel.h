#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace mpt::cuda {

// *slot = the GPU's global timer (nanoseconds), when `stream` gets there.
void launch_gpu_stamp(uint64_t* slot, cudaStream_t stream);

}  // namespace mpt::cuda
