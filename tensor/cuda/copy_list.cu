// Many tensors copied (scaled, and cast where the two dtypes differ) with
// one kernel launch, multi-tensor style as amp's unscale does it: the lists
// travel in the kernel's parameters and each block takes one chunk of one
// tensor. It fills DDP's buckets (every gradient of a bucket divided by the
// world size, and cast when it travels compressed) and casts autocast's
// weights ahead of forward. One launch per tensor costs more than the
// copying itself for models with many small parameters.
#include "tensor/cuda/copy_list.h"
#include "tensor/cuda/kernel_utils.cuh"
#include "tensor/cuda/multi_tensor.cuh"
#include "tensor/cuda/runtime.h"

namespace mpt::cuda {
namespace {

constexpr int kMaxTensors = 40;    // per launch
constexpr int kMaxBlocks = 256;    // per launch; the struct stays under the 4 KiB parameter limit
constexpr int kBlockThreads = 512;

struct CopyChunks {
  const void* srcs[kMaxTensors];
  void* dsts[kMaxTensors];
  int64_t sizes[kMaxTensors];
  BlockTable<kMaxBlocks> blocks;
};
static_assert(sizeof(CopyChunks) < 4000, "kernel parameters are limited to 4 KiB");

template <typename Src, typename Dst>
__device__ __forceinline__ Dst scaled(Src x, float scale) {
  return Element<Dst>::store(Element<Src>::load(x) * scale);
}

template <typename Src, typename Dst>
__global__ void scaled_copy_kernel(CopyChunks list, float scale) {
  const BlockChunk c = this_block_chunk(list.blocks, [&](int slot) { return list.sizes[slot]; });
  const Src* src = static_cast<const Src*>(list.srcs[c.slot]) + c.begin;
  Dst* dst = static_cast<Dst*>(list.dsts[c.slot]) + c.begin;
  const int64_t n = c.count;

  // 16-byte accesses on the wider side (the narrower one moves half that).
  constexpr int kVec = 16 / (sizeof(Src) > sizeof(Dst) ? sizeof(Src) : sizeof(Dst));
  int64_t vector_end = 0;
  if (reinterpret_cast<uintptr_t>(src) % (sizeof(Src) * kVec) == 0 &&
      reinterpret_cast<uintptr_t>(dst) % (sizeof(Dst) * kVec) == 0) {
    vector_end = n / kVec * kVec;
    const auto* in = reinterpret_cast<const Pack<Src, kVec>*>(src);
    auto* out = reinterpret_cast<Pack<Dst, kVec>*>(dst);
    for_each_pack(
        n / kVec, [&](int64_t i) { return in[i]; },
        [&](int64_t i, const Pack<Src, kVec>& a) {
          Pack<Dst, kVec> b;
#pragma unroll
          for (int j = 0; j < kVec; ++j) b.v[j] = scaled<Src, Dst>(a.v[j], scale);
          out[i] = b;
        });
  }
  for (int64_t i = vector_end + threadIdx.x; i < n; i += blockDim.x) dst[i] = scaled<Src, Dst>(src[i], scale);
}

template <typename Src, typename Dst>
void scaled_copy_list(const void* const* srcs, void* const* dsts, const int64_t* sizes, size_t count, float scale,
                      cudaStream_t stream) {
  CopyChunks list;
  list.blocks.chunk = chunk_for(sizes, count, multiprocessor_count(current_device()));
  plan_chunked_launches(
      list.blocks, sizes, count, kMaxTensors,
      [&](int slot, size_t i) {
        list.srcs[slot] = srcs[i];
        list.dsts[slot] = dsts[i];
        list.sizes[slot] = sizes[i];
      },
      [&](int blocks) {
        scaled_copy_kernel<Src, Dst><<<blocks, kBlockThreads, 0, stream>>>(list, scale);
        MPT_CUDA_CHECK_LAUNCH("scaled_copy_kernel");
      });
}

}  // namespace

void launch_scaled_copy_list(DType src_dtype, DType dst_dtype, const void* const* srcs, void* const* dsts,
                             const int64_t* sizes, size_t count, float scale, cudaStream_t stream) {
  dispatch_floating<false>(src_dtype, "scaled_copy_list", [&](auto src_tag) {
    dispatch_floating<false>(dst_dtype, "scaled_copy_list", [&](auto dst_tag) {
      scaled_copy_list<decltype(src_tag), decltype(dst_tag)>(srcs, dsts, sizes, count, scale, stream);
    });
  });
}

}  // namespace mpt::cuda
