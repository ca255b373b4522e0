#include "tensor/cuda/event_pool.h"

#include "tensor/cuda/check.h"
#include "tensor/cuda/recycled_handles.h"

namespace mpt::cuda {
namespace {

RecycledHandles<cudaEvent_t>& pool() {
  // Leaked on purpose: destroying events during static destruction could
  // run after the CUDA driver has shut down.
  static auto* p = new RecycledHandles<cudaEvent_t>([] {
    cudaEvent_t e = nullptr;
    MPT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  });
  return *p;
}

}  // namespace

cudaEvent_t acquire_event(int device) { return pool().take(device); }

void release_event(int device, cudaEvent_t event) noexcept { pool().give_back(device, event); }

}  // namespace mpt::cuda
