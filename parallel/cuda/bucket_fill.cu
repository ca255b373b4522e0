// DDP's bucket fill: every gradient of a bucket copied (and divided by the
// world size) into its slot with one kernel launch, multi-tensor style as
// amp's unscale does it: the lists travel in the kernel's parameters and
// each block takes one chunk of one tensor. One launch per gradient cost
// more than the copying itself for models with many small parameters
// (gpt_mini: 77 gradients, about 2 us each inside a replayed graph).
#include "parallel/cuda/bucket_fill_kernels.h"
#include "tensor/cuda/kernel_utils.cuh"
#include "tensor/cuda/multi_tensor.cuh"

namespace mpt::dist::cuda {
namespace {

using mpt::cuda::Element;
using mpt::cuda::Pack;

constexpr int kMaxTensors = 40;    // per launch
constexpr int kMaxBlocks = 256;    // per launch; the struct stays under the 4 KiB parameter limit
constexpr int64_t kChunk = 65536;  // elements per block (a multiple of every pack width: chunks keep alignment)
constexpr int kBlockThreads = 512;

struct CopyChunks {
  const void* srcs[kMaxTensors];
  void* dsts[kMaxTensors];
  int64_t sizes[kMaxTensors];
  unsigned char block_to_tensor[kMaxBlocks];
  int block_to_chunk[kMaxBlocks];
};
static_assert(sizeof(CopyChunks) < 4000, "kernel parameters are limited to 4 KiB");

template <typename T>
__device__ __forceinline__ T scaled(T x, float scale) {
  return Element<T>::store(Element<T>::load(x) * scale);
}

template <typename T>
__global__ void scaled_copy_kernel(CopyChunks list, float scale) {
  const int tensor = list.block_to_tensor[blockIdx.x];
  const int64_t start = static_cast<int64_t>(list.block_to_chunk[blockIdx.x]) * kChunk;
  const T* src = static_cast<const T*>(list.srcs[tensor]) + start;
  T* dst = static_cast<T*>(list.dsts[tensor]) + start;
  const int64_t n = min(kChunk, list.sizes[tensor] - start);

  constexpr int kVec = 16 / sizeof(T);
  int64_t vector_end = 0;
  if (reinterpret_cast<uintptr_t>(src) % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
    vector_end = n / kVec * kVec;
    const auto* in = reinterpret_cast<const Pack<T, kVec>*>(src);
    auto* out = reinterpret_cast<Pack<T, kVec>*>(dst);
    for (int64_t i = threadIdx.x; i < n / kVec; i += blockDim.x) {
      Pack<T, kVec> pack = in[i];
#pragma unroll
      for (int j = 0; j < kVec; ++j) pack.v[j] = scaled(pack.v[j], scale);
      out[i] = pack;
    }
  }
  for (int64_t i = vector_end + threadIdx.x; i < n; i += blockDim.x) dst[i] = scaled(src[i], scale);
}

template <typename T>
void scaled_copy_list(const void* const* srcs, void* const* dsts, const int64_t* sizes, size_t count, float scale,
                      cudaStream_t stream) {
  CopyChunks list;
  mpt::cuda::plan_chunked_launches(
      list, sizes, count, kChunk, kMaxTensors,
      [&](int slot, size_t i) {
        list.srcs[slot] = srcs[i];
        list.dsts[slot] = dsts[i];
        list.sizes[slot] = sizes[i];
      },
      [&](int blocks) {
        scaled_copy_kernel<T><<<blocks, kBlockThreads, 0, stream>>>(list, scale);
        MPT_CUDA_CHECK_LAUNCH("scaled_copy_kernel");
      });
}

}  // namespace

void launch_scaled_copy_list(DType dtype, const void* const* srcs, void* const* dsts, const int64_t* sizes,
                             size_t count, float scale, cudaStream_t stream) {
  mpt::cuda::dispatch_floating<false>(dtype, "scaled_copy_list", [&](auto tag) {
    scaled_copy_list<decltype(tag)>(srcs, dsts, sizes, count, scale, stream);
  });
}

}  // namespace mpt::dist::cuda
