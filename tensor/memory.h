#pragma once
// Statistics and control of the CUDA caching allocator and, for the CPU
// device, of the host block cache (tensor/cpu/host_block_cache.h).
#include <cstdint>

#include "tensor/device.h"
#include "tensor/stream.h"

namespace mpt {

struct MemoryStats {
  uint64_t allocated_bytes = 0;       // handed out to tensors now (size-class rounded)
  uint64_t reserved_bytes = 0;        // obtained from cudaMalloc and held (in use + cached)
  uint64_t peak_allocated_bytes = 0;  // since start or the last reset_peak_memory_stats
  uint64_t peak_reserved_bytes = 0;
  uint64_t num_allocs = 0;            // requests served
  uint64_t num_device_mallocs = 0;    // of those, how many needed cudaMalloc
  uint64_t num_device_frees = 0;      // cudaFree calls (empty_cache, OOM retry)
};

MemoryStats memory_stats(const Device& device);
void reset_peak_memory_stats(const Device& device);
// Returns every cached, unused block of every device to the driver, and
// the host cache's to the system.
void empty_cache();
// Makes the block behind `ptr` safe to reuse only after the work now queued
// on `stream` (a stream other than the one it was allocated on) is done.
void record_stream(void* ptr, const Stream& stream);

}  // namespace mpt
