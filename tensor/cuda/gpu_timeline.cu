#include "tensor/cuda/gpu_timeline_kernel.h"
#include "tensor/cuda/kernel_utils.cuh"

namespace mpt::cuda {
namespace {

__global__ void gpu_stamp_kernel(uint64_t* slot) {
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  *slot = now;
}

}  // namespace

void launch_gpu_stamp(uint64_t* slot, cudaStream_t stream) {
  gpu_stamp_kernel<<<1, 1, 0, stream>>>(slot);
  MPT_CUDA_CHECK_LAUNCH("gpu_stamp_kernel");
}

}  // namespace mpt::cuda
