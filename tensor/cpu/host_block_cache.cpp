#include "tensor/cpu/host_block_cache.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "tensor/environment.h"
#include "tensor/error.h"
#include "tensor/size_class.h"

#if defined(__SANITIZE_ADDRESS__)
#define MPT_HOST_CACHE_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MPT_HOST_CACHE_ASAN 1
#endif
#endif
#ifdef MPT_HOST_CACHE_ASAN
#include <sanitizer/asan_interface.h>
#endif

namespace mpt::host_cache {

namespace {

constexpr size_t kAlign = 64;

#ifdef MPT_HOST_CACHE_ASAN
void poison(void* p, size_t n) { ASAN_POISON_MEMORY_REGION(p, n); }
void unpoison(void* p, size_t n) { ASAN_UNPOISON_MEMORY_REGION(p, n); }
#else
void poison(void*, size_t) {}
void unpoison(void*, size_t) {}
#endif

[[noreturn]] void throw_out_of_memory(size_t nbytes) {
  throw OutOfMemoryError(fmt::format("cpu: could not allocate {} bytes of host memory", nbytes));
}

size_t aligned_size(size_t nbytes) { return (std::max<size_t>(nbytes, 1) + kAlign - 1) / kAlign * kAlign; }

void* system_allocate(size_t nbytes) { return std::aligned_alloc(kAlign, aligned_size(nbytes)); }

size_t limit_from_environment() {
#ifdef MPT_HOST_CACHE_ASAN
  // A block reused at once would hide a use after free from ASan's
  // quarantine: sanitized builds keep nothing unless told to.
  constexpr size_t kDefaultMb = 0;
#else
  constexpr size_t kDefaultMb = 4096;
#endif
  const auto mb = whole_number_from_environment("MPT_CPU_CACHE_MB", 0, 1LL << 30);
  return static_cast<size_t>(mb.value_or(kDefaultMb)) << 20;
}

class Cache {
 public:
  Cache() : limit_(limit_from_environment()) {}

  void* allocate(size_t nbytes) {
    const size_t size = rounded_size(nbytes);
    {
      std::lock_guard lock(mutex_);
      ++stats_.num_allocs;
      count_in(size);
      if (auto it = free_.find(size); it != free_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        unpoison(p, size);
        return p;
      }
      ++stats_.num_device_mallocs;
      stats_.reserved_bytes += size;
      stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
    }
    void* p = system_allocate(size);
    if (p == nullptr) {
      empty();
      p = system_allocate(size);
    }
    if (p == nullptr) {
      std::lock_guard lock(mutex_);
      stats_.allocated_bytes -= size;
      stats_.reserved_bytes -= size;
      throw_out_of_memory(nbytes);
    }
    return p;
  }

  void release(void* p, size_t nbytes) {
    const size_t size = rounded_size(nbytes);
    {
      std::lock_guard lock(mutex_);
      const bool keep = cached_bytes() + size <= limit_;
      stats_.allocated_bytes -= size;
      if (keep) {
        free_[size].push_back(p);
        poison(p, size);
        return;
      }
      stats_.reserved_bytes -= size;
      ++stats_.num_device_frees;
    }
    std::free(p);
  }

  void empty() { trim_to(0); }

  void set_limit(size_t bytes) {
    {
      std::lock_guard lock(mutex_);
      limit_ = bytes;
    }
    trim_to(bytes);
  }

  size_t limit() {
    std::lock_guard lock(mutex_);
    return limit_;
  }

  MemoryStats stats() {
    std::lock_guard lock(mutex_);
    return stats_;
  }

  void reset_peak() {
    std::lock_guard lock(mutex_);
    stats_.peak_allocated_bytes = stats_.allocated_bytes;
    stats_.peak_reserved_bytes = stats_.reserved_bytes;
  }

 private:
  uint64_t cached_bytes() const { return stats_.reserved_bytes - stats_.allocated_bytes; }

  void count_in(size_t size) {
    stats_.allocated_bytes += size;
    stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
  }

  // Frees cached blocks, the largest classes first, until at most `bytes` stay.
  void trim_to(size_t bytes) {
    std::vector<std::pair<void*, size_t>> freed;
    {
      std::lock_guard lock(mutex_);
      std::vector<size_t> sizes;
      for (const auto& [size, blocks] : free_)
        if (!blocks.empty()) sizes.push_back(size);
      std::sort(sizes.rbegin(), sizes.rend());
      for (size_t size : sizes) {
        auto& blocks = free_[size];
        while (!blocks.empty() && cached_bytes() > bytes) {
          freed.emplace_back(blocks.back(), size);
          blocks.pop_back();
          stats_.reserved_bytes -= size;
          ++stats_.num_device_frees;
        }
      }
    }
    for (auto [p, size] : freed) {
      unpoison(p, size);
      std::free(p);
    }
  }

  std::mutex mutex_;
  size_t limit_;
  MemoryStats stats_;
  std::unordered_map<size_t, std::vector<void*>> free_;
};

// Never destroyed: tensors held by static objects may be freed after main().
Cache& cache() {
  static Cache* instance = new Cache();
  return *instance;
}

}  // namespace

size_t rounded_size(size_t nbytes) {
  return nbytes < kMinCachedBytes ? aligned_size(nbytes) : eighth_power_of_two_class(nbytes);
}

void* allocate(size_t nbytes) {
  if (nbytes > kMaxAllocationRequest) throw_out_of_memory(nbytes);
  if (nbytes >= kMinCachedBytes) return cache().allocate(nbytes);
  void* p = system_allocate(nbytes);
  if (p == nullptr) throw_out_of_memory(nbytes);
  return p;
}

void release(void* p, size_t nbytes) {
  if (p == nullptr) return;
  if (nbytes < kMinCachedBytes) {
    std::free(p);
    return;
  }
  cache().release(p, nbytes);
}

MemoryStats stats() { return cache().stats(); }
void reset_peak() { cache().reset_peak(); }
void empty() { cache().empty(); }
void set_limit(size_t bytes) { cache().set_limit(bytes); }
size_t limit() { return cache().limit(); }

}  // namespace mpt::host_cache
