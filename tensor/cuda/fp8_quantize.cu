// FP8 quantization on the GPU: out = fp8(in * scale) with the hardware's
// saturating conversion (cvt.rn.satfinite, what cuda_fp8.h's
// __nv_cvt_float_to_fp8 with __NV_SATFINITE becomes on sm_89+), the
// transpose for the backward products written in the same pass, and the
// running amax, one atomic per block.
//
// Where every size is a multiple of 16 and the pointers are 16-byte aligned
// (always so for the shapes FP8 GEMMs take), a block quantizes 64 x 64
// tiles: each thread reads 16 consecutive elements of a row (kept as the
// 16-byte loads brought them, see Chunk) and stores their 16 codes with one
// 16-byte store, two codes a conversion; the tile's codes go through shared
// memory (Fp8TileCodes, swizzled), and each thread then gathers 16 codes of
// a column for one 16-byte store into the transpose. Other shapes take a
// plain grid-stride loop.
//
// A prologue (Fp8Prologue: a ReLU's backward, GELU either way) is applied
// to each element as it is loaded, with the element-wise kernels' own
// formulas (gelu_math.cuh; this file builds with --fmad=false, as theirs
// does) and rounded to the input's dtype as they would store it: the same
// codes as the op's pass followed by quantization, without the op's pass.
// The tiled kernel takes the prologue as a template parameter, so that
// GELU's code and registers stay out of the other quantizations: with a
// run-time switch, mlp_large's FP8 step (no GELU in it) measured 9.9-10.0
// ms where it had been 9.5-9.7 (two H100s; docs/PERFORMANCE.md).
#include <cuda_fp8.h>

#include <type_traits>

#include "tensor/cuda/fp8_codes.cuh"
#include "tensor/cuda/fp8_quantize.h"
#include "tensor/cuda/gelu_math.cuh"
#include "tensor/cuda/kernel_utils.cuh"

namespace mpt::cuda {
namespace {

constexpr int kTile = kFp8Tile;
constexpr int kChunk = kFp8Chunk;  // elements a thread handles at once

// The element that the quantization sees: x (from `in`) after the
// prologue (a: the prologue's second operand, from `aux`, where it has
// one), rounded to T (which also gives a NaN the payload the op's store
// would).
template <typename T>
__device__ __forceinline__ float prologue_value(Fp8Prologue prologue, float x, float a) {
  auto rounded = [](float v) { return Element<T>::load(Element<T>::store(v)); };
  switch (prologue) {
    case Fp8Prologue::none: return x;
    case Fp8Prologue::relu_backward: return rounded(a > 0.0f ? x : 0.0f);
    case Fp8Prologue::gelu_erf: return rounded(gelu_erf_value(x));
    case Fp8Prologue::gelu_tanh: return rounded(gelu_tanh_value(x));
    case Fp8Prologue::gelu_erf_backward: return rounded(x * gelu_erf_grad(a));
    case Fp8Prologue::gelu_tanh_backward: return rounded(x * gelu_tanh_grad(a));
  }
  return x;
}

// A thread's kChunk consecutive elements of a row, loaded with 16-byte
// loads and kept as they came: a Pack of bf16 was unpacked by the compiler
// into a register per element on load, which took the GELU backward's
// pass to 100 registers, two blocks an SM.
template <typename T>
struct Chunk {
  static constexpr int kWords = kChunk * static_cast<int>(sizeof(T)) / 4;
  uint32_t w[kWords];

  __device__ __forceinline__ void load(const T* p) {
#pragma unroll
    for (int i = 0; i < kWords / 4; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[i];
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  }
  // Element i as f32 (exact for every T).
  __device__ __forceinline__ float operator[](int i) const {
    if constexpr (sizeof(T) == 4) {
      return __uint_as_float(w[i]);
    } else {
      const uint32_t word = w[i / 2];
      const auto bits = static_cast<unsigned short>(i % 2 ? word >> 16 : word & 0xffffu);
      if constexpr (std::is_same_v<T, __nv_bfloat16>)
        return __uint_as_float(static_cast<uint32_t>(bits) << 16);
      else
        return __half2float(__ushort_as_half(bits));
    }
  }
};

// Blocks an SM: six (40 registers) where the prologue reads one input,
// four (64) where it reads two; the more blocks, the more bytes in flight.
constexpr int min_blocks_per_sm(Fp8Prologue p) { return fp8_prologue_has_aux(p) ? 4 : 6; }

// A block quantizes kTiles tiles stacked along the rows, its loads for all
// of them issued before any is used: a 16-bit tile alone gave a thread 32
// bytes in flight, and on an H100 the pass ran at 60% of the memory's speed
// where the f32 one, with 64, ran at 87%. Measured since: mlp_large's FP8
// step 9.89 -> 9.65 ms (two H100s), no gain at GPT-2 small's shapes. The
// column sums stay per tile of kTile rows (kFp8ColumnSumBlock), whatever
// kTiles is.
template <typename T, int kTiles, bool kSums, Fp8Prologue kPrologue>
__global__ void __launch_bounds__(kThreads, min_blocks_per_sm(kPrologue))
    quantize_tiles(const T* __restrict__ in, const T* __restrict__ aux, uint8_t* __restrict__ out,
                   uint8_t* __restrict__ out_t, int64_t rows, int64_t cols, const float* scale_ptr, float* scale_inv,
                   float* amax, float* partial_sums, __nv_fp8_interpretation_t format) {
  constexpr bool kAux = fp8_prologue_has_aux(kPrologue);
  __shared__ alignas(16) Fp8TileCodes tile[kTiles];
  // The values of one tile, for its column sums (each column summed
  // by one thread in row order: the same bits every run).
  __shared__ float values[kSums ? kTile : 1][kTile + 1];
  const float scale = *scale_ptr;
  const int64_t first_tile = static_cast<int64_t>(blockIdx.y) * kTiles;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int r = threadIdx.x / (kTile / kChunk), c = (threadIdx.x % (kTile / kChunk)) * kChunk;
  auto inside = [&](int t) { return (first_tile + t) * kTile + r < rows && col0 + c < cols; };
  auto at = [&](int t) { return ((first_tile + t) * kTile + r) * cols + col0 + c; };
  Chunk<T> chunks[kTiles], aux_chunks[kAux ? kTiles : 1];
#pragma unroll
  for (int t = 0; t < kTiles; ++t)
    if (inside(t)) {
      chunks[t].load(in + at(t));
      if constexpr (kAux) aux_chunks[t].load(aux + at(t));
    }
  uint32_t bits = 0;
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    const int64_t row0 = (first_tile + t) * kTile;
    if (row0 >= rows) break;  // the whole block: the last block's missing tiles
    if (inside(t)) {
      uint32_t codes[kChunk / 4] = {};  // four codes a word, the first in the low byte
#pragma unroll
      for (int i = 0; i < kChunk; i += 2) {
        float v[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          v[j] = prologue_value<T>(kPrologue, chunks[t][i + j], kAux ? aux_chunks[t][i + j] : 0.0f);
          bits = max(bits, abs_bits(v[j]));
          if constexpr (kSums) values[r][c + i + j] = v[j];
        }
        codes[i / 4] |= to_fp8_pair(v[0] * scale, v[1] * scale, format) << (i % 4 * 8);
      }
      const uint4 packed = make_uint4(codes[0], codes[1], codes[2], codes[3]);
      *reinterpret_cast<uint4*>(out + at(t)) = packed;
      if (out_t) store_tile_chunk(tile[t], r, c, packed);
    } else if constexpr (kSums) {
#pragma unroll
      for (int i = 0; i < kChunk; ++i) values[r][c + i] = 0.0f;
    }
    if (out_t || kSums) __syncthreads();
    if (out_t) store_transposed_chunk(tile[t], r, c, row0, col0, rows, cols, out_t);
    if constexpr (kSums) {
      if (threadIdx.x < kTile && col0 + threadIdx.x < cols) {
        float sum = 0.0f;
        for (int i = 0; i < kTile; ++i) sum += values[i][threadIdx.x];
        partial_sums[(first_tile + t) * cols + col0 + threadIdx.x] = sum;
      }
      __syncthreads();  // before the next tile's values
    }
  }
  if (amax) block_amax(bits, amax);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *scale_inv = 1.0f / scale;
}

template <typename T>
__device__ __forceinline__ float value_at(const T* in, const T* aux, Fp8Prologue prologue, int64_t i) {
  return prologue_value<T>(prologue, Element<T>::load(in[i]), aux ? Element<T>::load(aux[i]) : 0.0f);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_any(const T* __restrict__ in, const T* __restrict__ aux,
                                                          Fp8Prologue prologue, uint8_t* __restrict__ out,
                                                          uint8_t* __restrict__ out_t, int64_t rows, int64_t cols,
                                                          const float* scale_ptr, float* scale_inv, float* amax,
                                                          __nv_fp8_interpretation_t format) {
  const float scale = *scale_ptr;
  uint32_t bits = 0;
  for (int64_t i = global_thread(); i < rows * cols; i += grid_threads()) {
    const float v = value_at(in, aux, prologue, i);
    bits = max(bits, abs_bits(v));
    const uint8_t code = to_fp8(v * scale, format);
    out[i] = code;
    if (out_t) out_t[(i % cols) * rows + i / cols] = code;
  }
  if (amax) block_amax(bits, amax);
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = 1.0f / scale;
}

// partial_sums [row blocks, cols]: each block of kTile rows of a column
// summed in order, by one thread.
template <typename T>
__global__ void column_block_sums(const T* __restrict__ in, const T* __restrict__ aux, Fp8Prologue prologue,
                                  int64_t rows, int64_t cols, float* partial_sums) {
  const int64_t blocks = (rows + kTile - 1) / kTile;
  for (int64_t i = global_thread(); i < blocks * cols; i += grid_threads()) {
    const int64_t b = i / cols, c = i % cols;
    float sum = 0.0f;
    for (int64_t r = b * kTile; r < min(rows, (b + 1) * kTile); ++r) sum += value_at(in, aux, prologue, r * cols + c);
    partial_sums[i] = sum;
  }
}

// column_sums[c] = the partial sums of column c in block order: a chain of
// adds a column, hundreds long (256 blocks of rows for GPT-2 small's 16384
// rows), and few columns (768 to 3072). A thread a column, loading its own
// partial sums 64 at a time, took 14 us a call (Nsight Compute, H100): the
// loads waited on the memory four times over. So a block takes 32 columns:
// its eight warps stage up to kFinishStage partial sums of them in shared
// memory together, one wait, and its first warp then adds them in order.
constexpr int kFinishStage = 256;
constexpr int kFinishColumns = 32;
__global__ void __launch_bounds__(kThreads) finish_column_sums(const float* __restrict__ partial_sums, int64_t blocks,
                                                                int64_t cols, float* column_sums) {
  __shared__ float staged[kFinishStage][kFinishColumns];
  const int lane = threadIdx.x % kFinishColumns, warp = threadIdx.x / kFinishColumns;
  constexpr int kWarps = kThreads / kFinishColumns;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kFinishColumns + lane;
  float sum = 0.0f;
  for (int64_t b0 = 0; b0 < blocks; b0 += kFinishStage) {
    const int n = static_cast<int>(min(static_cast<int64_t>(kFinishStage), blocks - b0));
#pragma unroll 8
    for (int i = warp; i < n; i += kWarps) staged[i][lane] = c < cols ? partial_sums[(b0 + i) * cols + c] : 0.0f;
    __syncthreads();
    if (warp == 0) {
#pragma unroll 16
      for (int i = 0; i < n; ++i) sum += staged[i][lane];
    }
    __syncthreads();  // before the next stage overwrites
  }
  if (warp == 0 && c < cols) column_sums[c] = sum;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) amax_kernel(const T* __restrict__ in, int64_t n, float* amax) {
  uint32_t bits = 0;
  for (int64_t i = global_thread(); i < n; i += grid_threads()) bits = max(bits, abs_bits(Element<T>::load(in[i])));
  block_amax(bits, amax);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Calls f(std::integral_constant<Fp8Prologue, p>{}).
template <typename F>
void with_prologue(Fp8Prologue p, F&& f) {
  using P = Fp8Prologue;
  switch (p) {
    case P::none: return f(std::integral_constant<P, P::none>{});
    case P::relu_backward: return f(std::integral_constant<P, P::relu_backward>{});
    case P::gelu_erf: return f(std::integral_constant<P, P::gelu_erf>{});
    case P::gelu_tanh: return f(std::integral_constant<P, P::gelu_tanh>{});
    case P::gelu_erf_backward: return f(std::integral_constant<P, P::gelu_erf_backward>{});
    case P::gelu_tanh_backward: return f(std::integral_constant<P, P::gelu_tanh_backward>{});
  }
}

}  // namespace

size_t quantize_fp8_scratch_bytes(const Fp8QuantizeArgs& q) {
  if (!q.column_sums.data) return 0;
  const int64_t rows = q.in.shape[0], cols = q.in.shape[1];
  return static_cast<size_t>((rows + kTile - 1) / kTile * cols) * sizeof(float);
}

void launch_quantize_fp8(const Launch& l, const Fp8QuantizeArgs& q, void* scratch) {
  static_assert(kTile == kFp8ColumnSumBlock, "the column sums' block order is the tiles'");
  const int64_t rows = q.in.shape[0], cols = q.in.shape[1];
  if (rows * cols == 0) return;
  const __nv_fp8_interpretation_t format = q.out.dtype == DType::e4m3 ? __NV_E4M3 : __NV_E5M2;
  auto* out = static_cast<uint8_t*>(q.out.data);
  auto* out_t = static_cast<uint8_t*>(q.out_t.data);
  const auto* scale = static_cast<const float*>(q.scale.data);
  auto* scale_inv = static_cast<float*>(q.scale_inv.data);
  auto* amax = static_cast<float*>(q.amax.data);
  auto* partial_sums = q.column_sums.data ? static_cast<float*>(scratch) : nullptr;
  dispatch_floating<false>(q.in.dtype, "quantize_fp8", [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(q.in.data);
    const T* aux = static_cast<const T*>(q.aux.data);
    // Two tiles a block for 16-bit inputs (see quantize_tiles), one for f32.
    constexpr int kTiles = sizeof(T) == 2 ? 2 : 1;
    const int64_t row_tiles = (rows + kTile - 1) / kTile;
    const bool tiles = rows % kChunk == 0 && cols % kChunk == 0 && aligned16(in) && aligned16(out) &&
                       (!out_t || aligned16(out_t)) && (!aux || aligned16(aux)) &&
                       (row_tiles + kTiles - 1) / kTiles <= 65535;
    if (tiles) {
      const dim3 grid(static_cast<unsigned>((cols + kTile - 1) / kTile),
                      static_cast<unsigned>((row_tiles + kTiles - 1) / kTiles));
      with_prologue(q.prologue, [&](auto prologue) {
        constexpr Fp8Prologue kPrologue = decltype(prologue)::value;
        if (partial_sums)
          quantize_tiles<T, kTiles, true, kPrologue><<<grid, kThreads, 0, l.stream>>>(
              in, aux, out, out_t, rows, cols, scale, scale_inv, amax, partial_sums, format);
        else
          quantize_tiles<T, kTiles, false, kPrologue><<<grid, kThreads, 0, l.stream>>>(
              in, aux, out, out_t, rows, cols, scale, scale_inv, amax, nullptr, format);
      });
      MPT_CUDA_CHECK_LAUNCH("quantize_fp8 (tiles)");
    } else {
      quantize_any<T><<<grid_for(l, rows * cols), kThreads, 0, l.stream>>>(in, aux, q.prologue, out, out_t, rows,
                                                                            cols, scale, scale_inv, amax, format);
      MPT_CUDA_CHECK_LAUNCH("quantize_fp8");
      if (partial_sums) {
        column_block_sums<T><<<grid_for(l, (rows + kTile - 1) / kTile * cols), kThreads, 0, l.stream>>>(
            in, aux, q.prologue, rows, cols, partial_sums);
        MPT_CUDA_CHECK_LAUNCH("quantize_fp8 column sums");
      }
    }
  });
  if (partial_sums) {
    const auto blocks = static_cast<unsigned>((cols + kFinishColumns - 1) / kFinishColumns);
    finish_column_sums<<<blocks, kThreads, 0, l.stream>>>(partial_sums, (rows + kTile - 1) / kTile, cols,
                                                           static_cast<float*>(q.column_sums.data));
    MPT_CUDA_CHECK_LAUNCH("quantize_fp8 column sums (finish)");
  }
}

void launch_amax_into(const Launch& l, const TensorView& amax, const TensorView& in) {
  const int64_t n = in.numel();
  if (n == 0) return;
  dispatch_floating<false>(in.dtype, "amax_into", [&](auto tag) {
    using T = decltype(tag);
    amax_kernel<T><<<grid_for(l, n), kThreads, 0, l.stream>>>(static_cast<const T*>(in.data), n,
                                                             static_cast<float*>(amax.data));
    MPT_CUDA_CHECK_LAUNCH("amax_into");
  });
}

}  // namespace mpt::cuda
