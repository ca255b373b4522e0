#pragma once
// Internal: what the tensor core needs from the CUDA side. Implemented in
// tensor/cuda/ when CUDA is built, and by stubs that throw DeviceError
// otherwise.
#include <cstddef>
#include <memory>

#include "tensor/device.h"
#include "tensor/storage.h"

namespace mpt {

// Memory for a tensor on a CUDA device, from the caching allocator, tied to
// the device's current stream.
std::shared_ptr<Storage> cuda_storage(size_t nbytes, const Device& device);

// Copies nbytes between two contiguous buffers where at least one is on a
// CUDA device. Runs on the current stream of the CUDA side (the
// destination's, device to device); returns once a host destination holds the data.
void memcpy_between(void* dst, const Device& dst_device, const void* src, const Device& src_device, size_t nbytes);

}  // namespace mpt

namespace mpt {

// Page-locked host memory from the host cache (tensor/pinned.h); null when
// CUDA is not built or no device is present.
std::shared_ptr<Storage> pinned_host_storage(size_t nbytes);
// Whether `ptr` lies in a block of the pinned host cache.
bool is_pinned_host_memory(const void* ptr);

}  // namespace mpt
