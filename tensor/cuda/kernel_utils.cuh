#pragma once
// Device-side building blocks shared by the kernel files: element types and
// their compute types, 16-byte packs, strided offsets, launch shapes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

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

// Calls f(T{}) with the storage type T of a floating dtype (f64 only when
// kWithF64); any other dtype is a DTypeError naming `op`.
template <bool kWithF64 = true, typename F>
void dispatch_floating(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::f32: return f(float{});
    case DType::f16: return f(__half{});
    case DType::bf16: return f(__nv_bfloat16{});
    case DType::f64:
      if constexpr (kWithF64) return f(double{});
      [[fallthrough]];
    default: throw_dtype_unsupported(op, dtype);
  }
}

// N elements moved as one aligned load or store (16 bytes at most).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

__device__ __forceinline__ uint32_t divide(const FastDivisor& d, uint32_t n) {
  return (__umulhi(n, d.magic) + n) >> d.shift;
}

// Offsets (in elements) of linear index `linear` in each operand. Index is
// uint32_t whenever the element count allows, dividing by multiplication;
// else 64-bit division. The outermost index is what is left, undivided. The
// loop runs over the compile-time bound so the operand arrays stay in the
// parameter bank instead of being copied to local memory.
template <int N, typename Index>
__device__ __forceinline__ void strided_offsets(const Strided<N>& s, Index linear, int64_t (&off)[N]) {
#pragma unroll
  for (int n = 0; n < N; ++n) off[n] = 0;
#pragma unroll
  for (int d = 0; d < kMaxDims; ++d) {
    Index i = linear;
    if (d < s.ndim - 1) {
      Index next;
      if constexpr (sizeof(Index) == 4) next = divide(s.divisors[d], linear);
      else next = linear / static_cast<Index>(s.shape[d]);
      i = linear - next * static_cast<Index>(s.shape[d]);
      linear = next;
    }
#pragma unroll
    for (int n = 0; n < N; ++n) off[n] += static_cast<int64_t>(i) * s.strides[n][d];
    if (d == s.ndim - 1) break;
  }
}

// Grid-stride loop over `count` items of `s`, item i being element i * scale,
// calling f(offsets of that element).
template <int N, typename F>
__device__ __forceinline__ void for_each_strided(const Strided<N>& s, int64_t count, int scale, F&& f) {
  int64_t off[N];
  if (count * scale <= INT32_MAX) {
    const uint32_t step = gridDim.x * blockDim.x;
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < static_cast<uint32_t>(count); i += step) {
      strided_offsets<N, uint32_t>(s, i * scale, off);
      f(off);
    }
  } else {
    const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
         i < static_cast<uint64_t>(count); i += step) {
      strided_offsets<N, uint64_t>(s, i * scale, off);
      f(off);
    }
  }
}

__device__ __forceinline__ int64_t global_thread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_threads() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// The sum and the maximum of a value over the 32 lanes of a warp, in every lane.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Whether every pointer allows Pack loads of `bytes`.
inline bool aligned_to(size_t bytes, std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % bytes != 0) return false;
  return true;
}

// How an element-wise kernel walks its operands.
enum class Layout : uint8_t {
  // The innermost dimension has stride 1 in every operand (0 is allowed for
  // an input: a broadcast) and runs in 16-byte aligned Packs, so loads and
  // stores move 16 bytes and offsets are computed once per Pack. Contiguous
  // operands are the one-dimensional case; only there the innermost size
  // need not be a whole number of Packs (the remainder goes element-wise).
  packed,
  strided,  // anything else: offsets computed per element
};

template <int N>
Layout choose_layout(const Strided<N>& s, size_t element_size, bool allow_broadcast = true) {
  const int64_t v = 16 / static_cast<int64_t>(element_size);
  if (s.ndim > 1 && s.shape[0] % v != 0) return Layout::strided;
  for (int n = 0; n < N; ++n) {
    const int64_t inner = s.strides[n][0];
    if (inner == 0 && n > 0 && allow_broadcast) continue;  // one element per Pack, whatever its alignment
    if (inner != 1 || reinterpret_cast<uintptr_t>(s.data[n]) % 16 != 0) return Layout::strided;
    for (int d = 1; d < s.ndim; ++d)
      if (s.strides[n][d] % v != 0) return Layout::strided;
  }
  return Layout::packed;
}

// Threads a launch needs for n elements in `layout`.
inline int64_t layout_work(Layout layout, int64_t n, size_t element_size) {
  return layout == Layout::packed ? n / (16 / static_cast<int64_t>(element_size)) + 1 : n;
}

}  // namespace mpt::cuda
