#include "tensor/storage.h"

#include <cstdlib>

#include "tensor/device_memory.h"
#include "tensor/error.h"

namespace mpt {

void* cpu_allocate(size_t nbytes) {
  constexpr size_t kAlign = 64;
  const size_t rounded = (std::max<size_t>(nbytes, 1) + kAlign - 1) / kAlign * kAlign;
  void* p = std::aligned_alloc(kAlign, rounded);
  if (!p) throw OutOfMemoryError(fmt::format("cpu: could not allocate {} bytes of host memory", nbytes));
  return p;
}

void cpu_free(void* p) { std::free(p); }

std::shared_ptr<Storage> Storage::allocate(size_t nbytes, const Device& device) {
  if (device.is_cuda()) return cuda_storage(nbytes, device);
  return std::make_shared<Storage>(cpu_allocate(nbytes), nbytes, device, cpu_free);
}

}  // namespace mpt
