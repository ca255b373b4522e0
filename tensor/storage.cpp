#include "tensor/storage.h"

#include "tensor/cpu/host_block_cache.h"
#include "tensor/device_memory.h"

namespace mpt {

std::shared_ptr<Storage> Storage::allocate(size_t nbytes, const Device& device) {
  if (device.is_cuda()) return cuda_storage(nbytes, device);
  return std::make_shared<Storage>(host_cache::allocate(nbytes), nbytes, device,
                                   [nbytes](void* p) { host_cache::release(p, nbytes); });
}

std::shared_ptr<Storage> Storage::take_narrow_copy(DType dtype, int64_t offset, int64_t numel) {
  std::shared_ptr<const NarrowCopy> copy = narrow_copy_.load();
  if (!copy || copy->dtype != dtype || copy->offset != offset || copy->numel != numel) return nullptr;
  // Whoever empties the slot first has it; anyone else casts.
  if (!narrow_copy_.compare_exchange_strong(copy, nullptr)) return nullptr;
  const bool current = copy->version == version() && copy->copy_version == copy->storage->version();
  return current ? copy->storage : nullptr;
}

}  // namespace mpt
