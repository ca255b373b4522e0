#pragma once
// Internal to tensor/: runs a backend call with the tensor's device current.
#include "tensor/backend.h"
#include "tensor/device_guard.h"
#include "tensor/tensor.h"

namespace mpt {

// A backend's view of an optional operand: null data where it is absent.
inline TensorView view_or_none(const Tensor& t) { return t.defined() ? t.view() : TensorView{}; }

template <typename F>
void on_device(const Device& d, F&& f) {
  DeviceGuard guard(d);
  f(backend_for(d));
}

}  // namespace mpt
