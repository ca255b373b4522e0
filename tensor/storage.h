#pragma once
// A block of device or host memory shared by a tensor and its views. Freed
// through the allocator it came from when the last holder lets go.
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "tensor/device.h"

namespace mpt {

class Storage {
 public:
  using Deleter = std::function<void(void*)>;
  Storage(void* data, size_t nbytes, Device device, Deleter deleter)
      : data_(data), nbytes_(nbytes), device_(device), deleter_(std::move(deleter)) {}
  ~Storage() {
    if (deleter_) deleter_(data_);
  }
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  // nbytes on `device`, from the host block cache (tensor/cpu/host_block_cache.h) or the CUDA caching
  // allocator (on the device's current stream).
  static std::shared_ptr<Storage> allocate(size_t nbytes, const Device& device);

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  const Device& device() const { return device_; }

  // How many times the memory was written in place through the tensor API
  // after it was made (PyTorch's version counter, shared by every view). A
  // backward rule checks that what it saved was not changed since forward,
  // and autocast's weight-cast cache that its casts are of current values.
  uint64_t version() const { return version_.load(std::memory_order_relaxed); }
  void bump_version() { version_.fetch_add(1, std::memory_order_relaxed); }

 private:
  void* data_;
  size_t nbytes_;
  Device device_;
  Deleter deleter_;
  std::atomic<uint64_t> version_{0};
};

}  // namespace mpt
