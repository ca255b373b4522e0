#pragma once
// A block of device or host memory shared by a tensor and its views. Freed
// through the allocator it came from when the last holder lets go.
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "tensor/device.h"
#include "tensor/dtype.h"

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

  // A copy of some of this memory's values in a narrower dtype, written by
  // the kernel that wrote them: the layer norm's backward writes the
  // residual stream's f32 gradient and, in the same pass, the 16-bit copy
  // that the branch's linear layer reads, so that no cast reads it again.
  // prim::to takes it instead of casting while it still holds the values:
  // this memory's version is the one it was made at and the copy itself was
  // not written since. Taken at most once, so whoever takes it owns it, as
  // it would own a cast.
  struct NarrowCopy {
    std::shared_ptr<Storage> storage;  // the copy's memory, its elements from 0
    DType dtype;
    int64_t offset;  // the elements of this memory it copies: [offset, offset + numel)
    int64_t numel;
    uint64_t version;       // this memory's version when it was made
    uint64_t copy_version;  // the copy's own version then
  };
  void set_narrow_copy(NarrowCopy copy) {
    narrow_copy_.store(std::make_shared<const NarrowCopy>(std::move(copy)));
  }
  // The copy, if it holds the elements [offset, offset + numel) in dtype;
  // it is no longer kept here after that.
  std::shared_ptr<Storage> take_narrow_copy(DType dtype, int64_t offset, int64_t numel);

 private:
  void* data_;
  size_t nbytes_;
  Device device_;
  Deleter deleter_;
  std::atomic<uint64_t> version_{0};
  std::atomic<std::shared_ptr<const NarrowCopy>> narrow_copy_;
};

}  // namespace mpt
