// FP8 quantization on the GPU: out = fp8(in * scale) with the hardware's
// saturating conversion (cvt.rn.satfinite, what cuda_fp8.h's
// __nv_cvt_float_to_fp8 with __NV_SATFINITE becomes on sm_89+), the
// transpose for the backward products written in the same pass, and the
// running amax, one atomic per block.
//
// Where every size is a multiple of 16 and the pointers are 16-byte aligned
// (always so for the shapes FP8 GEMMs take), a block quantizes 64 x 64
// tiles: each thread reads 16 consecutive elements of a row and stores their
// 16 codes with one 16-byte store, the tile's codes go through shared
// memory, and each thread then gathers 16 codes of a column for one
// 16-byte store into the transpose. Other shapes take a plain grid-stride
// loop.
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

// The element that the quantization sees: `in` after the prologue (aux:
// the prologue's second operand, where it has one), rounded to T (which
// also gives a NaN the payload the op's store would).
template <typename T>
__device__ __forceinline__ float prologue_value(Fp8Prologue prologue, T in, T aux) {
  const float x = Element<T>::load(in);
  auto rounded = [](float v) { return Element<T>::load(Element<T>::store(v)); };
  switch (prologue) {
    case Fp8Prologue::none: return x;
    case Fp8Prologue::relu_backward: return rounded(Element<T>::load(aux) > 0.0f ? x : 0.0f);
    case Fp8Prologue::gelu_erf: return rounded(gelu_erf_value(x));
    case Fp8Prologue::gelu_tanh: return rounded(gelu_tanh_value(x));
    case Fp8Prologue::gelu_erf_backward: return rounded(x * gelu_erf_grad(Element<T>::load(aux)));
    case Fp8Prologue::gelu_tanh_backward: return rounded(x * gelu_tanh_grad(Element<T>::load(aux)));
  }
  return x;
}

// A block quantizes kTiles tiles stacked along the rows, its loads for all
// of them issued before any is used: a 16-bit tile alone gave a thread 32
// bytes in flight, and on an H100 the pass ran at 60% of the memory's speed
// where the f32 one, with 64, ran at 87%. Measured since: mlp_large's FP8
// step 9.89 -> 9.65 ms (two H100s), no gain at GPT-2 small's shapes. The
// column sums stay per tile of kTile rows (kFp8ColumnSumBlock), whatever
// kTiles is.
template <typename T, int kTiles, bool kSums, Fp8Prologue kPrologue>
__global__ void __launch_bounds__(kThreads) quantize_tiles(const T* __restrict__ in, const T* __restrict__ aux,
                                                            uint8_t* __restrict__ out, uint8_t* __restrict__ out_t,
                                                            int64_t rows, int64_t cols, const float* scale_ptr,
                                                            float* scale_inv, float* amax, float* partial_sums,
                                                            __nv_fp8_interpretation_t format) {
  using P = Pack<T, 16 / sizeof(T)>;
  constexpr int kPerPack = 16 / sizeof(T), kPacks = kChunk / kPerPack;
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
  P packs[kTiles][kPacks], aux_packs[kTiles][kPacks];
#pragma unroll
  for (int t = 0; t < kTiles; ++t)
    if (inside(t)) {
#pragma unroll
      for (int p = 0; p < kPacks; ++p) packs[t][p] = reinterpret_cast<const P*>(in + at(t))[p];
      if (aux) {
#pragma unroll
        for (int p = 0; p < kPacks; ++p) aux_packs[t][p] = reinterpret_cast<const P*>(aux + at(t))[p];
      }
    }
  uint32_t bits = 0;
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    const int64_t row0 = (first_tile + t) * kTile;
    if (row0 >= rows) break;  // the whole block: the last block's missing tiles
    if (inside(t)) {
      Pack<uint8_t, kChunk> codes;
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        const float v = prologue_value(kPrologue, packs[t][i / kPerPack].v[i % kPerPack],
                                       aux ? aux_packs[t][i / kPerPack].v[i % kPerPack] : T{});
        bits = max(bits, abs_bits(v));
        codes.v[i] = to_fp8(v * scale, format);
        if constexpr (kSums) values[r][c + i] = v;
      }
      *reinterpret_cast<Pack<uint8_t, kChunk>*>(out + at(t)) = codes;
      if (out_t) *reinterpret_cast<Pack<uint8_t, kChunk>*>(&tile[t][r][c]) = codes;
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
  return prologue_value(prologue, in[i], aux ? aux[i] : T{});
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

// Adds partial sums b, b + 1, ... b + N - 1 of column c to `sum` in that
// order, all N loaded before the first add.
template <int N>
__device__ __forceinline__ float add_in_order(float sum, const float* __restrict__ partial_sums, int64_t b,
                                              int64_t cols, int64_t c) {
  float batch[N];
#pragma unroll
  for (int i = 0; i < N; ++i) batch[i] = partial_sums[(b + i) * cols + c];
#pragma unroll
  for (int i = 0; i < N; ++i) sum += batch[i];
  return sum;
}

// column_sums[c] = the partial sums of column c in block order. A thread
// per column, so the threads are few (768 for GPT-2's 768 columns) and each
// reads hundreds of partial sums: loaded 64 at a time ahead of their adds,
// so that the loads overlap instead of each waiting on the memory in turn
// (50 us a call for 256 blocks of rows one load at a time, 18 us sixteen
// at a time).
__global__ void finish_column_sums(const float* __restrict__ partial_sums, int64_t blocks, int64_t cols,
                                   float* column_sums) {
  for (int64_t c = global_thread(); c < cols; c += grid_threads()) {
    float sum = 0.0f;
    int64_t b = 0;
    for (; b + 64 <= blocks; b += 64) sum = add_in_order<64>(sum, partial_sums, b, cols, c);
    for (; b + 8 <= blocks; b += 8) sum = add_in_order<8>(sum, partial_sums, b, cols, c);
    for (; b < blocks; ++b) sum = add_in_order<1>(sum, partial_sums, b, cols, c);
    column_sums[c] = sum;
  }
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
    // A warp a block: the columns are few (768 to 3072 for GPT-2 small), and
    // blocks of kThreads put them all on a handful of SMs, whose loads then
    // queue (14 us a call under Nsight Compute).
    constexpr int kWarp = 32;
    finish_column_sums<<<grid_for(l, cols, kWarp), kWarp, 0, l.stream>>>(
        partial_sums, (rows + kTile - 1) / kTile, cols, static_cast<float*>(q.column_sums.data));
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
