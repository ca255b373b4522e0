#pragma once
// Device-side FP8 encoding shared by the quantizing kernels
// (fp8_quantize.cu) and the optimizer's step that writes FP8 weight copies
// (models/cuda/fused_optim.cu), so that both give the same codes and amax.
#include <cuda_fp8.h>

#include <cstdint>

#include "tensor/cuda/kernel_utils.cuh"

namespace mpt::cuda {

// v's code in `format`, rounded to nearest even and saturated to the
// largest finite value (NaN stays NaN).
__device__ __forceinline__ uint8_t to_fp8(float v, __nv_fp8_interpretation_t format) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, format));
}

// |x| as bits: every NaN lies above infinity, so a NaN anywhere wins (the
// CPU's amax uses the same order).
__device__ __forceinline__ uint32_t abs_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }

// The block's largest abs_bits into *amax (an f32 read as its bits), one
// atomic a block; every thread of the block must call it.
__device__ __forceinline__ void block_amax(uint32_t bits, float* amax) {
  __shared__ uint32_t warp_max[kThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o /= 2) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, o));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_max[warp] = bits;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t m = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) m = max(m, warp_max[w]);
    atomicMax(reinterpret_cast<uint32_t*>(amax), m);
  }
}

}  // namespace mpt::cuda
