#pragma once
// Device-side building blocks shared by the kernel files: element types and
// their compute types, 16-byte packs, strided offsets, launch shapes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "tensor/cuda/check.h"
#include "tensor/cuda/kernels.h"

namespace mpt::cuda {

constexpr int kThreads = 256;

// Blocks for a grid-stride loop over `work` items: enough to fill every SM
// once (2048 resident threads each), no more; extra blocks would only add
// scheduling overhead.
inline unsigned grid_for(const Launch& l, int64_t work, int threads = kThreads) {
  const int64_t want = (work + threads - 1) / threads;
  const int64_t wave = static_cast<int64_t>(l.sm_count) * (2048 / threads);
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(want, wave)));
}

// Storage type -> arithmetic type. Half types compute in f32 and round back
// with round-to-nearest-even (overflow to inf, NaN stays NaN), as the CPU does.
template <typename T>
struct Element;
template <>
struct Element<float> {
  using Compute = float;
  static __device__ __forceinline__ float load(float x) { return x; }
  static __device__ __forceinline__ float store(float x) { return x; }
};
template <>
struct Element<double> {
  using Compute = double;
  static __device__ __forceinline__ double load(double x) { return x; }
  static __device__ __forceinline__ double store(double x) { return x; }
};
template <>
struct Element<__half> {
  using Compute = float;
  static __device__ __forceinline__ float load(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half store(float x) { return __float2half_rn(x); }
};
template <>
struct Element<__nv_bfloat16> {
  using Compute = float;
  static __device__ __forceinline__ float load(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
};

// N elements moved as one aligned load or store (16 bytes at most).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Offsets (in elements) of linear index `linear` in each operand. Index is
// uint32_t whenever the element count allows: 64-bit division is several
// times slower. The loop runs over the compile-time bound so the operand
// arrays stay in the parameter bank instead of being copied to local memory.
template <int N, typename Index>
__device__ __forceinline__ void strided_offsets(const Strided<N>& s, Index linear, int64_t (&off)[N]) {
#pragma unroll
  for (int n = 0; n < N; ++n) off[n] = 0;
#pragma unroll
  for (int d = 0; d < kMaxDims; ++d) {
    if (d == s.ndim) break;
    const Index size = static_cast<Index>(s.shape[d]);
    const Index next = linear / size;
    const int64_t i = static_cast<int64_t>(linear - next * size);
    linear = next;
#pragma unroll
    for (int n = 0; n < N; ++n) off[n] += i * s.strides[n][d];
  }
}

// Grid-stride loop over the n elements of `s`, calling f(offsets).
template <int N, typename F>
__device__ __forceinline__ void for_each_strided(const Strided<N>& s, int64_t n, F&& f) {
  int64_t off[N];
  if (n <= INT32_MAX) {
    const uint32_t step = gridDim.x * blockDim.x;
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < static_cast<uint32_t>(n); i += step) {
      strided_offsets<N, uint32_t>(s, i, off);
      f(off);
    }
  } else {
    const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < static_cast<uint64_t>(n);
         i += step) {
      strided_offsets<N, uint64_t>(s, i, off);
      f(off);
    }
  }
}

__device__ __forceinline__ int64_t global_thread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_threads() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// Whether every pointer allows Pack loads of `bytes`.
inline bool aligned_to(size_t bytes, std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % bytes != 0) return false;
  return true;
}

}  // namespace mpt::cuda
