#include "tensor/storage.h"

#include "tensor/cpu/host_block_cache.h"
#include "tensor/device_memory.h"

namespace mpt {

std::shared_ptr<Storage> Storage::allocate(size_t nbytes, const Device& device) {
  if (device.is_cuda()) return cuda_storage(nbytes, device);
  return std::make_shared<Storage>(host_cache::allocate(nbytes), nbytes, device,
                                   [nbytes](void* p) { host_cache::release(p, nbytes); });
}

}  // namespace mpt
