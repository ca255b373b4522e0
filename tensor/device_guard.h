#pragma once
// Makes a CUDA device current for a scope (kernels and allocations go to the
// current device) and restores the previous one. Does nothing for the CPU.
#include "tensor/device.h"

namespace mpt {

class DeviceGuard {
 public:
  explicit DeviceGuard(const Device& d);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  [[maybe_unused]] int previous_ = -1;  // -1: nothing to restore (unread in a build without CUDA)
};

}  // namespace mpt
