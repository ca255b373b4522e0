#include "tensor/pinned.h"

#include "tensor/device_memory.h"
#include "tensor/ops.h"

namespace mpt {

Tensor empty_pinned(const Shape& shape, DType dtype) {
  const size_t nbytes = static_cast<size_t>(numel(shape)) * dtype_size(dtype);
  std::shared_ptr<Storage> storage = pinned_host_storage(nbytes);
  if (!storage) return Tensor::empty(shape, dtype, kCPU);
  return Tensor::view_of(std::move(storage), shape, contiguous_strides(shape), 0, dtype);
}

Tensor pin_memory(const Tensor& t) {
  check<DeviceError>(t.device().is_cpu(), "pin_memory: {} is not on the CPU", describe(t));
  Tensor out = empty_pinned(t.shape(), t.dtype());
  prim::copy_(out, t);
  return out;
}

bool is_pinned(const Tensor& t) { return t.defined() && t.device().is_cpu() && is_pinned_host_memory(t.data_ptr()); }

}  // namespace mpt
