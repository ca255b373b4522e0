// The scaler's CUDA kernels: the fused unscale + inf/NaN check over a list
// of gradients (multi-tensor apply, as PyTorch's multi_tensor_apply does it:
// the list travels in the kernel's parameters, each block takes one chunk of
// one tensor), and the one-thread scale update.
#include "amp/cuda/unscale_kernels.h"
#include "tensor/cuda/kernel_utils.cuh"
#include "tensor/cuda/multi_tensor.cuh"
#include "tensor/cuda/runtime.h"

namespace mpt::amp::cuda {
namespace {

using mpt::cuda::Element;
using mpt::cuda::Pack;

constexpr int kMaxTensors = 48;    // per launch
constexpr int kMaxBlocks = 320;    // per launch; the struct stays well under the 4 KiB parameter limit
constexpr int kBlockThreads = 512;

struct TensorChunks {
  void* addresses[kMaxTensors];
  int64_t sizes[kMaxTensors];
  mpt::cuda::BlockTable<kMaxBlocks> blocks;
};
static_assert(sizeof(TensorChunks) < 4000, "kernel parameters are limited to 4 KiB");

template <typename T>
__device__ __forceinline__ T unscale_one(T x, float inv_scale, bool& found) {
  const float v = Element<T>::load(x);
  found |= !isfinite(v);
  return Element<T>::store(v * inv_scale);
}

// kUnscale false: the check alone, nothing stored.
template <typename T, bool kUnscale>
__global__ void unscale_kernel(TensorChunks list, float* found_inf, const float* inv_scale_ptr) {
  const mpt::cuda::BlockChunk c = mpt::cuda::this_block_chunk(list.blocks, [&](int slot) { return list.sizes[slot]; });
  T* p = static_cast<T*>(list.addresses[c.slot]) + c.begin;
  const int64_t n = c.count;
  const float inv_scale = kUnscale ? *inv_scale_ptr : 1.0f;
  bool found = false;

  constexpr int kVec = 16 / sizeof(T);
  int64_t vector_end = 0;
  if (reinterpret_cast<uintptr_t>(p) % 16 == 0) {
    // 16-byte loads and stores over the aligned body.
    vector_end = n / kVec * kVec;
    auto* packs = reinterpret_cast<Pack<T, kVec>*>(p);
    mpt::cuda::for_each_pack(
        n / kVec, [&](int64_t i) { return packs[i]; },
        [&](int64_t i, Pack<T, kVec> pack) {
#pragma unroll
          for (int j = 0; j < kVec; ++j) pack.v[j] = unscale_one(pack.v[j], inv_scale, found);
          if (kUnscale) packs[i] = pack;
        });
  }
  for (int64_t i = vector_end + threadIdx.x; i < n; i += blockDim.x) {
    const T v = unscale_one(p[i], inv_scale, found);
    if (kUnscale) p[i] = v;
  }
  // Every writer writes the same 1: the race is benign and needs no atomic.
  if (found) *found_inf = 1.0f;
}

template <typename T>
void unscale_list(void* const* grads, const int64_t* sizes, size_t count, float* found_inf, const float* inv_scale,
                  cudaStream_t stream) {
  TensorChunks list;
  list.blocks.chunk =
      mpt::cuda::chunk_for(sizes, count, mpt::cuda::multiprocessor_count(mpt::cuda::current_device()));
  mpt::cuda::plan_chunked_launches(
      list.blocks, sizes, count, kMaxTensors,
      [&](int slot, size_t i) {
        list.addresses[slot] = grads[i];
        list.sizes[slot] = sizes[i];
      },
      [&](int blocks) {
        if (inv_scale)
          unscale_kernel<T, true><<<blocks, kBlockThreads, 0, stream>>>(list, found_inf, inv_scale);
        else
          unscale_kernel<T, false><<<blocks, kBlockThreads, 0, stream>>>(list, found_inf, inv_scale);
        MPT_CUDA_CHECK_LAUNCH("unscale_kernel");
      });
}

__global__ void update_scale_kernel(float* scale, int64_t* growth_tracker, int32_t* hysteresis_left,
                                    const float* found_inf, ScaleRule rule, int64_t units) {
  update_scale(rule, *found_inf != 0.0f, units, scale, growth_tracker, hysteresis_left);
}

}  // namespace

void launch_unscale_and_check_inf(DType dtype, void* const* grads, const int64_t* sizes, size_t count,
                                  float* found_inf, const float* inv_scale, cudaStream_t stream) {
  mpt::cuda::dispatch_floating<false>(dtype, "unscale_and_check_inf", [&](auto tag) {
    unscale_list<decltype(tag)>(grads, sizes, count, found_inf, inv_scale, stream);
  });
}

void launch_update_scale(float* scale, int64_t* growth_tracker, int32_t* hysteresis_left, const float* found_inf,
                         const ScaleRule& rule, int64_t units, cudaStream_t stream) {
  update_scale_kernel<<<1, 1, 0, stream>>>(scale, growth_tracker, hysteresis_left, found_inf, rule, units);
  MPT_CUDA_CHECK_LAUNCH("update_scale_kernel");
}

}  // namespace mpt::amp::cuda
