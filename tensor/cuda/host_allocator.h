#pragma once
// Internal: the pinned host cache (tensor/cuda/host_allocator.cpp).
#include <cuda_runtime.h>

namespace mpt::cuda {

// Records that work queued on `stream` (of `device`) reads the pinned block
// holding `ptr`; the block is not reused before that work is done. Does
// nothing for memory outside the cache.
void record_pinned_use(const void* ptr, int device, cudaStream_t stream);

}  // namespace mpt::cuda
