#pragma once
// Multi-tensor launches (PyTorch's multi_tensor_apply): tensors are cut
// into chunks, each block of a launch takes one chunk of one tensor, and
// the launch's tables travel in the kernel's parameters, so one launch
// holds at most max_tensors tensors and kMaxBlocks chunks. On the host,
// chunk_for sizes the chunks and plan_chunked_launches fills the tables;
// on the device, this_block_chunk reads a block's entry and for_each_pack
// walks its chunk.
#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace mpt::cuda {

// Elements per block (a "chunk") for a list of `total` elements on a GPU of
// `sm_count` SMs: about two blocks per SM, so a small model's list still
// reaches every SM (a fixed chunk leaves most SMs idle for a model of a few
// hundred thousand parameters), and a launch's block table (a few hundred
// entries) holds them.
// A multiple of kMinChunk elements, so chunks start on 16-byte packs.
constexpr int64_t kMinChunk = 4096, kMaxChunk = 65536;
inline int64_t chunk_for(int64_t total, int sm_count) {
  const int64_t blocks = 2 * static_cast<int64_t>(std::max(1, sm_count));
  const int64_t chunk = (total + blocks - 1) / blocks;
  return std::clamp((chunk + kMinChunk - 1) / kMinChunk * kMinChunk, kMinChunk, kMaxChunk);
}
inline int64_t chunk_for(const int64_t* sizes, size_t count, int sm_count) {
  int64_t total = 0;
  for (size_t i = 0; i < count; ++i) total += sizes[i];
  return chunk_for(total, sm_count);
}

// One launch's block table: block b takes chunk block_to_chunk[b] (of
// `chunk` elements) of the tensor in slot block_to_tensor[b] of the
// launch's own list of tensors.
template <int kMaxBlocks>
struct BlockTable {
  unsigned char block_to_tensor[kMaxBlocks];
  int block_to_chunk[kMaxBlocks];
  int64_t chunk;  // elements per block (chunk_for)
};

// For each tensor i with sizes[i] > 0: add_tensor(slot, i) when it takes a
// slot of the current launch (a tensor whose chunks span two launches takes
// one in each), then its chunks go into `table`; launch(blocks) runs a full
// launch and the last. table.chunk is set by the caller.
template <int kMaxBlocks, typename AddTensor, typename Launch>
void plan_chunked_launches(BlockTable<kMaxBlocks>& table, const int64_t* sizes, size_t count, int max_tensors,
                           AddTensor add_tensor, Launch launch) {
  const int64_t chunk = table.chunk;
  int tensors = 0, blocks = 0;
  auto flush = [&] {
    if (blocks > 0) launch(blocks);
    tensors = blocks = 0;
  };
  for (size_t i = 0; i < count; ++i) {
    const int64_t n = sizes[i];
    if (n == 0) continue;
    int slot = -1;  // tensor i's slot in the current launch, once registered
    const int64_t chunks = (n + chunk - 1) / chunk;
    for (int64_t c = 0; c < chunks; ++c) {
      if (slot < 0) {
        if (tensors == max_tensors) flush();
        slot = tensors++;
        add_tensor(slot, i);
      }
      table.block_to_tensor[blocks] = static_cast<unsigned char>(slot);
      table.block_to_chunk[blocks] = static_cast<int>(c);
      if (++blocks == kMaxBlocks) {
        flush();
        slot = -1;
      }
    }
  }
  flush();
}

// This block's entry of `table`: the slot of its tensor, and the first
// element and the element count of its chunk, for a tensor of size(slot)
// elements.
struct BlockChunk {
  int slot;
  int64_t begin, count;
};
template <int kMaxBlocks, typename Size>
__device__ __forceinline__ BlockChunk this_block_chunk(const BlockTable<kMaxBlocks>& table, Size size) {
  const int slot = table.block_to_tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(table.block_to_chunk[blockIdx.x]) * table.chunk;
  return {slot, begin, min(table.chunk, static_cast<int64_t>(size(slot)) - begin)};
}

// A block's walk over `packs` 16-byte packs of its chunk: load(i) returns
// pack i, store(i, pack) consumes it. Each thread issues kUnroll loads before
// its first store: a small list has about one block per SM, and with one
// load in flight per thread a block moves a quarter of what the memory
// can (a 25 MiB gradient bucket filled in ~100 blocks).
template <int kUnroll = 4, typename Load, typename Store>
__device__ __forceinline__ void for_each_pack(int64_t packs, Load load, Store store) {
  using P = decltype(load(int64_t{}));
  const int64_t stride = blockDim.x;
  for (int64_t base = threadIdx.x; base < packs; base += stride * kUnroll) {
    P held[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + u * stride < packs) held[u] = load(base + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + u * stride < packs) store(base + u * stride, held[u]);
  }
}

}  // namespace mpt::cuda
