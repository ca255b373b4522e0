#pragma once
// CUDA handles (events, streams) that are handed back for reuse instead of
// destroyed, kept per device. Creating one costs a driver call; destroying
// one may come too early (work that still names it) or too late (after the
// driver shut down at exit). A pool lives as long as the process.
#include <mutex>
#include <vector>

#include "tensor/cuda/runtime.h"
#include "tensor/device_guard.h"

namespace mpt::cuda {

template <typename Handle>
class RecycledHandles {
 public:
  // `create` makes a new handle on the current device (it throws on failure).
  using Create = Handle (*)();
  explicit RecycledHandles(Create create) : create_(create) {}

  Handle take(int device) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (device < static_cast<int>(idle_.size()) && !idle_[device].empty()) {
        const Handle h = idle_[device].back();
        idle_[device].pop_back();
        return h;
      }
    }
    DeviceGuard guard(cuda_device(device));
    return create_();
  }

  // Out of host memory while growing the pool, the handle is forgotten:
  // a leak, nothing worse.
  void give_back(int device, Handle h) noexcept {
    try {
      std::lock_guard<std::mutex> lock(mutex_);
      if (device >= static_cast<int>(idle_.size())) idle_.resize(device + 1);
      idle_[device].push_back(h);
    } catch (...) {
    }
  }

 private:
  Create create_;
  std::mutex mutex_;
  std::vector<std::vector<Handle>> idle_;  // by device
};

}  // namespace mpt::cuda
