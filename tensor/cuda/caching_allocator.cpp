#include "tensor/cuda/caching_allocator.h"

#include <array>
#include <atomic>

#include <fmt/format.h>

#include "tensor/cpu/host_block_cache.h"
#include "tensor/cuda/check.h"
#include "tensor/cuda/event_pool.h"
#include "tensor/cuda/runtime.h"
#include "tensor/device_guard.h"
#include "tensor/device_memory.h"
#include "tensor/error.h"
#include "tensor/size_class.h"
#include "tensor/storage.h"

namespace mpt::cuda {
namespace {

constexpr size_t kMinBlock = 512;
constexpr size_t kSmallLimit = size_t(1) << 20;

std::string human_bytes(uint64_t n) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024.0 && u < 6) {
    v /= 1024.0;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", n) : fmt::format("{:.2f} {}", v, units[u]);
}

}  // namespace

size_t CachingAllocator::size_class(size_t nbytes) {
  if (nbytes < kSmallLimit) return nbytes <= kMinBlock ? kMinBlock : (nbytes + kMinBlock - 1) / kMinBlock * kMinBlock;
  return eighth_power_of_two_class(nbytes);
}

void* CachingAllocator::allocate(size_t nbytes, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (nbytes > kMaxAllocationRequest) throw_out_of_memory(nbytes, nbytes);
  const size_t size = size_class(nbytes);
  const int pool = in_capture(stream) ? capture_pool_ : 0;
  // Event queries are not allowed while a capture is open.
  if (!parked_.empty() && !capture_pool_) collect_parked(/*wait=*/false);

  Block* block = pool ? take_for_capture(size, stream) : take_cached(size, stream);
  if (!block) {
    void* ptr = device_malloc(size, nbytes);
    block = new Block{ptr, size, stream, {}, pool};
    stats_.num_device_mallocs += 1;
    stats_.reserved_bytes += size;
    stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
  }
  active_.emplace(block->ptr, block);
  stats_.num_allocs += 1;
  stats_.allocated_bytes += size;
  stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
  return block->ptr;
}

// The capture's own stream, or one that joined it (it waited on an event
// recorded in the capture, as a fork to a side stream does).
bool CachingAllocator::in_capture(cudaStream_t stream) const {
  if (!capture_pool_) return false;
  if (stream == capture_stream_) return true;
  if (!stream) return false;  // the legacy default stream never joins a capture
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone, capture_status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0, capture_id = 0;
  MPT_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, &id));
  if (status != cudaStreamCaptureStatusActive) return false;
  MPT_CUDA_CHECK(cudaStreamGetCaptureInfo(capture_stream_, &capture_status, &capture_id));
  return capture_status == cudaStreamCaptureStatusActive && id == capture_id;
}

CachingAllocator::Block* CachingAllocator::take_from_pool(int pool, size_t size, cudaStream_t stream) {
  auto& blocks = pools_[pool][FreeKey{stream, size}];
  if (blocks.empty()) return nullptr;
  Block* block = blocks.back();
  blocks.pop_back();
  cached_bytes_ -= block->size;
  return block;
}

// The pool's own block first; on the capture's own stream, then a cached
// block of the stream it follows: the graph's kernels on that block come
// after the work the origin had queued by the capture's end (a first replay
// on another stream waits for it, and later ones follow the first).
CachingAllocator::Block* CachingAllocator::take_for_capture(size_t size, cudaStream_t stream) {
  if (Block* block = take_from_pool(capture_pool_, size, stream)) return block;
  if (stream != capture_stream_) return nullptr;
  Block* block = take_cached(size, capture_origin_);
  if (block) {
    block->stream = stream;
    block->pool = capture_pool_;
  }
  return block;
}

CachingAllocator::Block* CachingAllocator::take_cached(size_t size, cudaStream_t stream) {
  auto it = free_.find(FreeKey{stream, size});
  if (it == free_.end() || it->second.empty()) return nullptr;
  Block* block = it->second.back();
  it->second.pop_back();
  cached_bytes_ -= block->size;
  return block;
}

void* CachingAllocator::device_malloc(size_t size, size_t requested) {
  DeviceGuard guard(cuda_device(device_));
  // cudaMalloc is not stream-ordered, so a capture forbids it unless this
  // thread relaxes the rule; the graph never sees the call, only the address.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  if (capture_pool_) MPT_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  void* ptr = nullptr;
  cudaError_t status = cudaMalloc(&ptr, size);
  if (capture_pool_) MPT_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  // Emptying the cache synchronizes the device: impossible during a capture.
  if (status == cudaErrorMemoryAllocation && capture_pool_) {
    (void)cudaGetLastError();
    throw_out_of_memory(requested, size);
  }
  if (status == cudaErrorMemoryAllocation) {
    // The memory may be sitting in this cache in the wrong size classes or
    // on other streams: give it all back to the driver and try once more.
    (void)cudaGetLastError();
    release_cached_blocks();
    status = cudaMalloc(&ptr, size);
    if (status == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      throw_out_of_memory(requested, size);
    }
  }
  if (status != cudaSuccess) throw_cuda_error(status, "cudaMalloc", __FILE__, __LINE__);
  return ptr;
}

void CachingAllocator::free(void* ptr) noexcept {
  if (!ptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = active_.find(ptr);
  if (it == active_.end()) return;  // not ours; nothing sensible to do in a destructor
  Block* block = it->second;
  active_.erase(it);
  stats_.allocated_bytes -= block->size;
  cached_bytes_ += block->size;

  if (block->pool && pools_.count(block->pool)) {
    // Other streams of the capture used it: the graph does not order their
    // work before a new tensor's in this same capture, so it waits for the
    // capture's end (every replay then runs all of it before the next).
    if (block->pool == capture_pool_ && !block->extra_streams.empty()) {
      held_until_capture_ends_.push_back(block);
      return;
    }
    pools_[block->pool][FreeKey{block->stream, block->size}].push_back(block);
    return;
  }
  block->pool = 0;
  cache_unused(block);
}

// Into the shared cache, or parked until the other streams that used the
// block are past their use. While a capture is open, the events that would
// mark that point cannot be recorded: on a stream in the capture they would
// become part of the graph (and a captured event cannot be queried), so
// such a block waits for the capture's end.
void CachingAllocator::cache_unused(Block* block) noexcept {
  try {
    if (block->extra_streams.empty()) {
      free_[FreeKey{block->stream, block->size}].push_back(block);
      return;
    }
    if (capture_pool_) {
      held_until_capture_ends_.push_back(block);
      return;
    }
    Parked parked{block, {}};
    parked.events.reserve(block->extra_streams.size());
    for (const auto& [device, stream] : block->extra_streams) {
      cudaEvent_t event = acquire_event(device);
      parked.events.emplace_back(device, event);
      DeviceGuard guard(cuda_device(device));
      MPT_CUDA_CHECK(cudaEventRecord(event, stream));
    }
    parked_.push_back(std::move(parked));
  } catch (...) {
    // Either host memory ran out or CUDA is failing (typically: the driver is
    // already shut down at process exit). Without the events the block can
    // never be proven idle, so it is not reused; it stays counted as reserved.
    (void)cudaGetLastError();
    cached_bytes_ -= block->size;
  }
}

bool CachingAllocator::record_stream(void* ptr, int stream_device, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  Block* block = nullptr;
  if (const auto it = active_.find(ptr); it != active_.end()) {
    block = it->second;
  } else {
    // A view into the block (a tensor with an offset). Rare enough for a scan.
    const auto* p = static_cast<const char*>(ptr);
    for (const auto& [base, b] : active_) {
      if (p >= static_cast<const char*>(base) && p < static_cast<const char*>(base) + b->size) {
        block = b;
        break;
      }
    }
  }
  if (!block) return false;
  if (stream_device == device_ && stream == block->stream) return true;
  for (const auto& s : block->extra_streams)
    if (s.first == stream_device && s.second == stream) return true;
  block->extra_streams.emplace_back(stream_device, stream);
  return true;
}

void CachingAllocator::collect_parked(bool wait) {
  for (size_t i = 0; i < parked_.size();) {
    Parked& p = parked_[i];
    while (!p.events.empty()) {
      const auto [device, event] = p.events.back();
      const cudaError_t status = wait ? cudaEventSynchronize(event) : cudaEventQuery(event);
      if (status == cudaErrorNotReady) {
        (void)cudaGetLastError();
        break;
      }
      MPT_CUDA_CHECK(status);
      release_event(device, event);
      p.events.pop_back();
    }
    if (!p.events.empty()) {
      ++i;
      continue;
    }
    Block* block = p.block;
    block->extra_streams.clear();
    free_[FreeKey{block->stream, block->size}].push_back(block);
    parked_[i] = std::move(parked_.back());
    parked_.pop_back();
  }
}

void CachingAllocator::release_cached_blocks() {
  DeviceGuard guard(cuda_device(device_));
  collect_parked(/*wait=*/true);
  // A cached block may still be read by kernels queued before its free;
  // wait for them before the memory goes back to the driver.
  MPT_CUDA_CHECK(cudaDeviceSynchronize());
  for (auto& [key, blocks] : free_) {
    while (!blocks.empty()) {
      Block* block = blocks.back();
      MPT_CUDA_CHECK(cudaFree(block->ptr));
      blocks.pop_back();
      stats_.num_device_frees += 1;
      stats_.reserved_bytes -= block->size;
      cached_bytes_ -= block->size;
      delete block;
    }
  }
  free_.clear();
}

void CachingAllocator::throw_out_of_memory(size_t requested, size_t size) const {
  DeviceGuard guard(cuda_device(device_));
  std::string device_info;
  size_t free_bytes = 0, total_bytes = 0;
  if (const cudaError_t status = cudaMemGetInfo(&free_bytes, &total_bytes); status == cudaSuccess) {
    device_info = fmt::format("the device has {} free of {} total", human_bytes(free_bytes), human_bytes(total_bytes));
  } else {
    (void)cudaGetLastError();
    device_info = fmt::format("cudaMemGetInfo failed: {}", cudaGetErrorName(status));
  }
  throw OutOfMemoryError(fmt::format(
      "CUDA out of memory on cuda:{}: tried to allocate {} bytes ({}{}); the caching allocator holds {} allocated "
      "to tensors and {} reserved from the driver, of which {} cached and unused; {}",
      device_, requested, human_bytes(requested),
      size != requested ? fmt::format(", rounded up to {} bytes", size) : std::string(),
      human_bytes(stats_.allocated_bytes), human_bytes(stats_.reserved_bytes), human_bytes(cached_bytes_),
      device_info));
}

int CachingAllocator::begin_capture(cudaStream_t stream, cudaStream_t origin) {
  std::lock_guard<std::mutex> lock(mutex_);
  check(capture_pool_ == 0, "caching allocator: cuda:{} already has a graph capture in progress", device_);
  capture_pool_ = next_pool_++;
  capture_stream_ = stream;
  capture_origin_ = origin;
  pools_[capture_pool_];
  return capture_pool_;
}

void CachingAllocator::end_capture() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<Block*> held;
  held.swap(held_until_capture_ends_);
  capture_pool_ = 0;
  capture_stream_ = nullptr;
  capture_origin_ = nullptr;
  for (Block* block : held) {
    if (block->pool && pools_.count(block->pool)) {
      // Only the graph's own streams used it, and every replay runs all
      // their work before the next.
      block->extra_streams.clear();
      pools_[block->pool][FreeKey{block->stream, block->size}].push_back(block);
    } else {
      // A block of the shared cache: its other streams' work so far was
      // queued outside the graph, and the events now recorded follow it.
      block->pool = 0;
      cache_unused(block);
    }
  }
}

void CachingAllocator::release_pool(int id, cudaStream_t home) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = pools_.find(id);
  if (it == pools_.end()) return;
  // Their last users ran in the replays. Left filed under the capture's
  // streams, they would serve only later work there, unordered with those
  // replays (and, once such a stream is destroyed, whichever new stream
  // gets its handle).
  for (auto& [ptr, block] : active_)
    if (block->pool == id) {
      block->pool = 0;
      block->stream = home;
    }
  for (auto& [key, blocks] : it->second)
    for (Block* block : blocks) {
      block->pool = 0;
      block->stream = home;
      cache_unused(block);  // parked if record_stream named other users
    }
  pools_.erase(it);
}

MemoryStats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void CachingAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.peak_allocated_bytes = stats_.allocated_bytes;
  stats_.peak_reserved_bytes = stats_.reserved_bytes;
}

void CachingAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  release_cached_blocks();
}

// ---- one allocator per device ---------------------------------------------------

namespace {

constexpr int kMaxDevices = 64;

struct Registry {
  std::mutex mutex;  // creation only; lookups read the atomics
  std::array<std::atomic<CachingAllocator*>, kMaxDevices> allocators{};
};

Registry& registry() {
  // Leaked with its allocators: freeing device memory during static
  // destruction could run after the CUDA driver has shut down.
  static auto* r = new Registry();
  return *r;
}

CachingAllocator* existing_allocator(int device) {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  return registry().allocators[device].load(std::memory_order_acquire);
}

}  // namespace

CachingAllocator& caching_allocator(int device) {
  check<DeviceError>(device >= 0 && device < kMaxDevices, "caching allocator: CUDA device index {} out of range",
                     device);
  if (CachingAllocator* a = existing_allocator(device)) return *a;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  CachingAllocator* a = r.allocators[device].load(std::memory_order_acquire);
  if (!a) {
    a = new CachingAllocator(device);
    r.allocators[device].store(a, std::memory_order_release);
  }
  return *a;
}

}  // namespace mpt::cuda

// ---- tensor/memory.h and tensor/device_memory.h -------------------------------------

namespace mpt {

MemoryStats memory_stats(const Device& device) {
  if (device.is_cpu()) return host_cache::stats();
  check_device_available(device);
  const cuda::CachingAllocator* a = cuda::existing_allocator(device.index);
  return a ? a->stats() : MemoryStats{};
}

void reset_peak_memory_stats(const Device& device) {
  if (device.is_cpu()) return host_cache::reset_peak();
  check_device_available(device);
  if (cuda::CachingAllocator* a = cuda::existing_allocator(device.index)) a->reset_peak();
}

void empty_cache() {
  host_cache::empty();
  for (int d = 0; d < cuda::kMaxDevices; ++d)
    if (cuda::CachingAllocator* a = cuda::existing_allocator(d)) a->empty_cache();
}

void record_stream(void* ptr, const Stream& stream) {
  if (!ptr || stream.device().is_cpu()) return;
  const int device = stream.device().index;
  const auto handle = static_cast<cudaStream_t>(stream.handle());
  // Usually the memory is on the stream's device; peer access makes any device possible.
  if (cuda::CachingAllocator* a = cuda::existing_allocator(device); a && a->record_stream(ptr, device, handle)) return;
  for (int d = 0; d < cuda::kMaxDevices; ++d) {
    if (d == device) continue;
    if (cuda::CachingAllocator* a = cuda::existing_allocator(d); a && a->record_stream(ptr, device, handle)) return;
  }
  throw ValueError(fmt::format("record_stream: {} is not memory handed out by the CUDA caching allocator",
                               fmt::ptr(ptr)));
}

std::shared_ptr<Storage> cuda_storage(size_t nbytes, const Device& device) {
  check<DeviceError>(device.is_cuda(), "cuda_storage: {} is not a CUDA device", device.str());
  cuda::check_device_usable(device);
  const int index = device.index;
  cuda::CachingAllocator& allocator = cuda::caching_allocator(index);
  void* ptr = allocator.allocate(nbytes, cuda::current_cuda_stream(index));
  try {
    return std::make_shared<Storage>(ptr, nbytes, device, [index](void* p) { cuda::caching_allocator(index).free(p); });
  } catch (...) {
    allocator.free(ptr);
    throw;
  }
}

}  // namespace mpt
