#pragma once
// Recycled CUDA events (timing disabled) for ordering work between streams:
// the caching allocator's cross-stream frees and cross-device copies record
// one per operation, and creating a fresh event each time would cost a
// driver call on the hot path.
#include <cuda_runtime.h>

namespace mpt::cuda {

// An event created on `device` (events can only be recorded on streams of
// the device they were created on).
cudaEvent_t acquire_event(int device);
// Back to the pool. Safe as soon as the last cudaEventRecord /
// cudaStreamWaitEvent on it has been issued: a wait binds to the record
// that precedes it, not to later ones.
void release_event(int device, cudaEvent_t event) noexcept;

}  // namespace mpt::cuda
