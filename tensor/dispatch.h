#pragma once
// Internal to tensor/: runs a backend call with the tensor's device current.
#include "tensor/backend.h"
#include "tensor/device_guard.h"

namespace mpt {

template <typename F>
void on_device(const Device& d, F&& f) {
  DeviceGuard guard(d);
  f(backend_for(d));
}

}  // namespace mpt
