#pragma once
// Internal: what the CUDA backend's cuDNN calls share (convolution, fused
// attention): a handle per thread and device bound to the current stream,
// and workspace from the caching allocator.
#include <cudnn.h>

#include <cstddef>

#include "tensor/cuda/caching_allocator.h"

namespace mpt::cuda {

// The calling thread's handle for `device`, set to the device's current
// stream. One handle per thread and device: a handle carries its stream,
// and two threads setting streams on one handle would race.
cudnnHandle_t cudnn_handle(int device);

// Workspace from the caching allocator, released as soon as the call is
// queued: only later work on the same stream can reuse it.
struct CudnnWorkspace {
  CachingAllocator& allocator;
  void* ptr = nullptr;
  CudnnWorkspace(int device, size_t bytes, cudaStream_t stream) : allocator(caching_allocator(device)) {
    if (bytes) ptr = allocator.allocate(bytes, stream);
  }
  ~CudnnWorkspace() { allocator.free(ptr); }
  CudnnWorkspace(const CudnnWorkspace&) = delete;
  CudnnWorkspace& operator=(const CudnnWorkspace&) = delete;
};

}  // namespace mpt::cuda
