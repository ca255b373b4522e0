#pragma once
// Device-side FP8 encoding shared by the quantizing kernels
// (fp8_quantize.cu) and the optimizer's step that writes FP8 weight copies
// (models/cuda/fused_optim.cu), so that both give the same codes and amax.
#include <cuda_fp8.h>

#include <cstdint>

#include "tensor/cuda/kernel_utils.cuh"

namespace mpt::cuda {

// The tiles the FP8 kernels write codes in: 64 x 64 elements, a thread for
// each 16 consecutive elements of a row (256 threads a tile), the tile's
// codes staged in shared memory for the transpose.
constexpr int kFp8Tile = 64;
constexpr int kFp8Chunk = 16;
using Fp8TileCodes = uint8_t[kFp8Tile][kFp8Tile];

// Where code (row, col) of a tile lies in its row of Fp8TileCodes: the
// row's four 16-byte chunks in an order that depends on the row (chunk k at
// k ^ (row / 16 % 4)). The transpose's gather reads one column from four
// rows 16 apart at once; with rows padded to 80 bytes instead, those reads
// hit the same bank four times over, with the chunks swizzled they hit
// four different banks.
__device__ __forceinline__ int tile_column(int row, int col) {
  return ((col / kFp8Chunk) ^ (row / kFp8Chunk % 4)) * kFp8Chunk + col % kFp8Chunk;
}

// The 16 codes of row r from column c (a multiple of 16) into the tile.
__device__ __forceinline__ void store_tile_chunk(Fp8TileCodes& tile, int r, int c, uint4 codes) {
  *reinterpret_cast<uint4*>(&tile[r][tile_column(r, c)]) = codes;
}

// Once the tile's codes are in `tile` (after a __syncthreads): the thread
// with row r and first column c of the tile writes column r's codes in rows
// c to c + 15 into out_t, the [cols, rows] transpose of the [rows, cols]
// matrix whose tile starts at (row0, col0), with one 16-byte store.
__device__ __forceinline__ void store_transposed_chunk(const Fp8TileCodes& tile, int r, int c, int64_t row0,
                                                       int64_t col0, int64_t rows, int64_t cols, uint8_t* out_t) {
  if (col0 + r >= cols || row0 + c >= rows) return;
  const int at = tile_column(c, r);  // the same in rows c to c + 15, c being a multiple of 16
  Pack<uint8_t, kFp8Chunk> codes;
#pragma unroll
  for (int i = 0; i < kFp8Chunk; ++i) codes.v[i] = tile[c + i][at];
  *reinterpret_cast<Pack<uint8_t, kFp8Chunk>*>(out_t + (col0 + r) * rows + row0 + c) = codes;
}

// v's code in `format`, rounded to nearest even and saturated to the
// largest finite value (NaN stays NaN).
__device__ __forceinline__ uint8_t to_fp8(float v, __nv_fp8_interpretation_t format) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, format));
}

// The codes of lo and hi as one 16-bit pair, lo in the low byte: one
// conversion instruction for two values, the same codes as to_fp8 on each.
__device__ __forceinline__ uint32_t to_fp8_pair(float lo, float hi, __nv_fp8_interpretation_t format) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, format);
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
