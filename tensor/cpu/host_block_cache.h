#pragma once
// Large host buffers kept for reuse instead of going back to the system.
//
// glibc hands out blocks above its mmap threshold (32 MB at most) as fresh
// mappings and unmaps them on free, so every training step that makes an
// activation of that size pays page faults and the kernel's zeroing of each
// page again: a third of gpt_mini's CPU step was system time. Blocks of
// kMinCachedBytes and more are rounded to a size class (at most 1/8 over
// the request) and, when freed, kept in a per-class free list up to a limit
// on the cached bytes; smaller ones go straight to malloc, whose arenas
// serve them well.
//
// The limit: MPT_CPU_CACHE_MB (default 4096; 0 turns caching off), or
// set_limit(). mpt::memory_stats(kCPU) reports it and mpt::empty_cache()
// returns every cached block to the system. Under AddressSanitizer the
// default limit is 0 (ASan's own quarantine then sees every free), and a
// block cached under a limit set by hand is poisoned.
#include <cstddef>
#include <cstdint>
#include <memory>

#include "tensor/memory.h"

namespace mpt::host_cache {

constexpr size_t kMinCachedBytes = size_t{1} << 20;

// 64-byte aligned, at least nbytes; throws OutOfMemoryError (after
// emptying the cache once) when the system has no more.
void* allocate(size_t nbytes);
// `nbytes` as given to allocate().
void release(void* p, size_t nbytes);

// Scratch memory of the CPU kernels (16-bit operands widened to f32 and the
// like) from the same cache: a block that goes back when the pointer dies.
struct Releaser {
  size_t nbytes;
  void operator()(void* p) const { release(p, nbytes); }
};
template <typename T>
using Buffer = std::unique_ptr<T[], Releaser>;
template <typename T>
Buffer<T> make_buffer(size_t count) {
  return Buffer<T>(static_cast<T*>(allocate(count * sizeof(T))), Releaser{count * sizeof(T)});
}

// The size a request of nbytes is served with (its class).
size_t rounded_size(size_t nbytes);

// Of the blocks of cached classes only (kMinCachedBytes and more), as the
// CUDA allocator's: allocated_bytes in tensors now (rounded), reserved_bytes
// those plus the cached ones, num_device_mallocs and num_device_frees the
// blocks taken from and given back to the system.
MemoryStats stats();
void reset_peak();
void empty();
// Bytes the cache may hold; lowering it frees what is over.
void set_limit(size_t bytes);
size_t limit();

}  // namespace mpt::host_cache
