// The pinned host memory cache behind tensor/pinned.h. Blocks are kept by
// size class (powers of two from 4 KiB) and never returned to the driver;
// a freed block is handed out again only once the copies recorded against
// it (record_pinned_use) have completed, so a loader can recycle batches
// without waiting for the GPU. One a CUDA graph copies from is never
// handed out again.
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "tensor/cuda/check.h"
#include "tensor/cuda/event_pool.h"
#include "tensor/cuda/host_allocator.h"
#include "tensor/cuda/runtime.h"
#include "tensor/device_guard.h"
#include "tensor/device_memory.h"

namespace mpt {
namespace cuda {
namespace {

class HostCache {
 public:
  void* allocate(size_t nbytes) {
    const size_t size = size_class(nbytes);
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [base, block] : blocks_)
      if (!block.in_use && !block.read_by_graph && block.size == size && copies_done(block)) {
        block.in_use = true;
        return reinterpret_cast<void*>(base);
      }
    void* p = nullptr;
    MPT_CUDA_CHECK(cudaHostAlloc(&p, size, cudaHostAllocPortable));
    blocks_[reinterpret_cast<uintptr_t>(p)] = Block{size, true, false, {}};
    return p;
  }

  void free(void* p) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (Block* b = find(p)) b->in_use = false;
  }

  bool contains(const void* p) {
    std::lock_guard<std::mutex> lock(mutex_);
    return find(p) != nullptr;
  }

  void record_use(const void* p, int device, cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    Block* b = find(p);
    if (!b) return;
    DeviceGuard guard(cuda_device(device));
    // A copy captured into a graph reads the block at every replay, for as
    // long as the graph lives, which this cache cannot see: the block is
    // never handed out again. (Nor could an event recorded in the capture
    // be queried.)
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    MPT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture != cudaStreamCaptureStatusNone) {
      b->read_by_graph = true;
      return;
    }
    cudaEvent_t e = acquire_event(device);
    MPT_CUDA_CHECK(cudaEventRecord(e, stream));
    b->pending.emplace_back(device, e);
  }

 private:
  struct Block {
    size_t size = 0;
    bool in_use = false;
    bool read_by_graph = false;                        // by a copy captured into a CUDA graph
    std::vector<std::pair<int, cudaEvent_t>> pending;  // copies that read the block
  };

  static size_t size_class(size_t nbytes) {
    size_t size = 4096;
    while (size < nbytes) size *= 2;
    return size;
  }

  // The block whose range holds p, or null.
  Block* find(const void* p) {
    const auto addr = reinterpret_cast<uintptr_t>(p);
    auto it = blocks_.upper_bound(addr);
    if (it == blocks_.begin()) return nullptr;
    --it;
    return addr < it->first + it->second.size ? &it->second : nullptr;
  }

  // Drops the completed copies; true when none is left.
  static bool copies_done(Block& b) {
    while (!b.pending.empty()) {
      const auto [device, e] = b.pending.back();
      const cudaError_t status = cudaEventQuery(e);
      if (status == cudaErrorNotReady) {
        (void)cudaGetLastError();
        return false;
      }
      MPT_CUDA_CHECK(status);
      release_event(device, e);
      b.pending.pop_back();
    }
    return true;
  }

  std::mutex mutex_;
  std::map<uintptr_t, Block> blocks_;  // by base address
};

HostCache& host_cache() {
  static auto* cache = new HostCache();  // leaked: pinned tensors may outlive static destruction
  return *cache;
}

}  // namespace

void record_pinned_use(const void* ptr, int device, cudaStream_t stream) {
  host_cache().record_use(ptr, device, stream);
}

}  // namespace cuda

std::shared_ptr<Storage> pinned_host_storage(size_t nbytes) {
  if (cuda_device_count() == 0) return nullptr;
  void* p = cuda::host_cache().allocate(nbytes);
  return std::make_shared<Storage>(p, nbytes, kCPU, [](void* q) { cuda::host_cache().free(q); });
}

bool is_pinned_host_memory(const void* ptr) { return cuda_device_count() > 0 && cuda::host_cache().contains(ptr); }

}  // namespace mpt
