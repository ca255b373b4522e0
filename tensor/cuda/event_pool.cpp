#include "tensor/cuda/event_pool.h"

#include <mutex>
#include <vector>

#include "tensor/cuda/check.h"
#include "tensor/cuda/runtime.h"
#include "tensor/device_guard.h"

namespace mpt::cuda {
namespace {

struct EventPool {
  std::mutex mutex;
  std::vector<std::vector<cudaEvent_t>> free_events;  // by device
};

EventPool& pool() {
  // Leaked on purpose: destroying events during static destruction could
  // run after the CUDA driver has shut down.
  static auto* p = new EventPool();
  return *p;
}

}  // namespace

cudaEvent_t acquire_event(int device) {
  EventPool& p = pool();
  {
    std::lock_guard<std::mutex> lock(p.mutex);
    if (device < static_cast<int>(p.free_events.size()) && !p.free_events[device].empty()) {
      cudaEvent_t e = p.free_events[device].back();
      p.free_events[device].pop_back();
      return e;
    }
  }
  DeviceGuard guard(cuda_device(device));
  cudaEvent_t e = nullptr;
  MPT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

void release_event(int device, cudaEvent_t event) noexcept {
  EventPool& p = pool();
  try {
    std::lock_guard<std::mutex> lock(p.mutex);
    if (device >= static_cast<int>(p.free_events.size())) p.free_events.resize(device + 1);
    p.free_events[device].push_back(event);
  } catch (...) {
    // Out of host memory while growing the pool: the event leaks, nothing else.
  }
}

}  // namespace mpt::cuda
