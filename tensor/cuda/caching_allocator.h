#pragma once
// The CUDA caching allocator: one per device, for the life of the process.
//
// cudaMalloc and cudaFree synchronize the device and cost tens of
// microseconds, far too slow to call for every tensor of a training step. So
// freed blocks are kept and handed out again. Requests are rounded up to size
// classes (multiples of 512 B below 1 MiB; above, eight steps per power of
// two, so at most 12.5% is wasted) and a block is reused only for the same
// class on the same stream: work on one stream runs in order, so memory
// freed there (while kernels using it may still be queued) is safe for the
// next kernel on that stream without any synchronization. A block that was
// also used on other streams (record_stream) is parked after the free until
// events recorded on those streams have completed.
//
// While a CUDA graph is captured on a stream, that stream's requests, and
// those of streams the capture forked to, come from a private pool of the
// graph (see begin_capture): the graph's kernels keep using those addresses
// at every replay, so no other tensor may get them while the graph lives.
// A block freed during the capture after record_stream named another
// stream is not handed out again until the capture ends (nor parked: the
// events that would park it cannot be recorded while the capture is open). When the graph
// goes, its memory returns to the shared cache on the stream
// its replays ran on, where a later capture from that stream (the same step
// on new shapes, say) can take it again.
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <cuda_runtime.h>

#include "tensor/memory.h"

namespace mpt::cuda {

class CachingAllocator {
 public:
  explicit CachingAllocator(int device) : device_(device) {}
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // A block of at least nbytes (0 gives a valid smallest block) for use on
  // `stream`. Throws OutOfMemoryError when even an emptied cache cannot make room.
  void* allocate(size_t nbytes, cudaStream_t stream);
  // Returns a block from allocate(). Never throws: it runs in destructors.
  void free(void* ptr) noexcept;
  // Whether ptr lies inside a block handed out by this allocator; if so, the
  // block will not be reused before the work now queued on `stream` (of
  // device stream_device) is done.
  bool record_stream(void* ptr, int stream_device, cudaStream_t stream);

  // From now on, requests on `stream` (being captured into a graph), and on
  // any stream that joins its capture, come from a new private pool; returns
  // its id. Blocks freed back into the pool serve later requests of the same
  // capture on the same stream (in order there). Requests on `stream` the
  // pool cannot serve take cached blocks of `origin` (the stream the
  // capture's work follows), so the graph's first replay must come after
  // the work `origin` had queued when the capture ended.
  int begin_capture(cudaStream_t stream, cudaStream_t origin);
  void end_capture();
  // The graph of pool `id` is gone and its replays have ended. Its blocks,
  // cached or still held by tensors, now belong to `home` (the stream the
  // replays ran on: every kernel of the graph, forks included, was ordered
  // there): cached ones return to the shared cache at once, held ones when
  // freed. A held one used on another stream than `home` needs
  // record_stream, as any tensor used off its own stream does.
  void release_pool(int id, cudaStream_t home);

  MemoryStats stats() const;
  void reset_peak();
  // cudaFree for every cached block, after waiting for parked ones.
  void empty_cache();

  static size_t size_class(size_t nbytes);

 private:
  struct Block {
    void* ptr = nullptr;
    size_t size = 0;              // the size class
    cudaStream_t stream = nullptr;  // allocated on; reused only there
    // Other streams that used the block: (device, stream).
    std::vector<std::pair<int, cudaStream_t>> extra_streams;
    int pool = 0;  // 0: the shared cache; else a graph's private pool
  };
  struct Parked {
    Block* block;
    std::vector<std::pair<int, cudaEvent_t>> events;  // (device of the event, event)
  };
  struct FreeKey {
    cudaStream_t stream;
    size_t size;
    bool operator==(const FreeKey&) const = default;
  };
  struct FreeKeyHash {
    size_t operator()(const FreeKey& k) const {
      return std::hash<const void*>()(k.stream) ^ (std::hash<size_t>()(k.size) * 0x9E3779B97F4A7C15ull);
    }
  };

  Block* take_cached(size_t size, cudaStream_t stream);
  Block* take_from_pool(int pool, size_t size, cudaStream_t stream);
  Block* take_for_capture(size_t size, cudaStream_t stream);
  void cache_unused(Block* block) noexcept;
  bool in_capture(cudaStream_t stream) const;
  void* device_malloc(size_t size, size_t requested);
  void collect_parked(bool wait);
  void release_cached_blocks();
  [[noreturn]] void throw_out_of_memory(size_t requested, size_t size) const;

  const int device_;
  mutable std::mutex mutex_;
  std::unordered_map<void*, Block*> active_;                          // handed out
  std::unordered_map<FreeKey, std::vector<Block*>, FreeKeyHash> free_;  // cached, ready to reuse
  std::vector<Parked> parked_;                                         // freed, waiting for other streams
  // Private pools of live graphs: cached blocks by stream and size class
  // (a capture may fork to other streams, whose work the graph orders only
  // through their events, so a block is reused on its own stream alone).
  std::unordered_map<int, std::unordered_map<FreeKey, std::vector<Block*>, FreeKeyHash>> pools_;
  int next_pool_ = 1;
  int capture_pool_ = 0;               // the pool of the capture in progress, if any
  std::vector<Block*> held_until_capture_ends_;  // freed in it after record_stream
  cudaStream_t capture_stream_ = nullptr;
  cudaStream_t capture_origin_ = nullptr;
  MemoryStats stats_;
  uint64_t cached_bytes_ = 0;  // free_ plus parked_
};

// The allocator of a CUDA device (created on first use, never destroyed).
CachingAllocator& caching_allocator(int device);

}  // namespace mpt::cuda
