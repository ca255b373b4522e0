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
#include <cuda_fp8.h>

#include "tensor/cuda/fp8_codes.cuh"
#include "tensor/cuda/fp8_quantize.h"
#include "tensor/cuda/gelu_math.cuh"
#include "tensor/cuda/kernel_utils.cuh"

namespace mpt::cuda {
namespace {

constexpr int kTile = kFp8Tile;
constexpr int kChunk = kFp8Chunk;  // elements a thread handles at once

// The element that the quantization sees: `in` after the prologue (aux:
// the prologue's second operand, where it has one), rounded to T.
template <typename T>
__device__ __forceinline__ float prologue_value(Fp8Prologue prologue, T in, T aux) {
  const float x = Element<T>::load(in);
  auto rounded = [](float v) { return Element<T>::load(Element<T>::store(v)); };
  switch (prologue) {
    case Fp8Prologue::none: return x;
    case Fp8Prologue::relu_backward: return Element<T>::load(aux) > 0.0f ? x : 0.0f;
    case Fp8Prologue::gelu_erf: return rounded(gelu_erf_value(x));
    case Fp8Prologue::gelu_tanh: return rounded(gelu_tanh_value(x));
    case Fp8Prologue::gelu_erf_backward: return rounded(x * gelu_erf_grad(Element<T>::load(aux)));
    case Fp8Prologue::gelu_tanh_backward: return rounded(x * gelu_tanh_grad(Element<T>::load(aux)));
  }
  return x;
}

// One wave of blocks (as many as fit on the GPU at once) walks the tiles
// with a stride of the grid, each block loading its next tile before it
// quantizes the current one, so that a thread keeps two tiles' loads in
// flight. Measured before, on H100s: a 16-bit tile a block (32 bytes in
// flight a thread) ran at 60% of the memory's speed where f32 (64 bytes)
// ran at 87%; two stacked tiles a block took mlp_large's FP8 step 9.89 ->
// 9.65 ms but gained nothing at GPT-2 small's shapes, where their 1536
// blocks made 1.45 waves, the second one half idle. Walking single tiles
// keeps both: the loads in flight, and a last round that is at most one
// tile a block. The column sums stay per tile of kTile rows
// (kFp8ColumnSumBlock).
template <typename T, bool kSums>
__global__ void __launch_bounds__(kThreads) quantize_tiles(const T* __restrict__ in, const T* __restrict__ aux,
                                                            Fp8Prologue prologue, uint8_t* __restrict__ out,
                                                            uint8_t* __restrict__ out_t, int64_t rows, int64_t cols,
                                                            const float* scale_ptr, float* scale_inv, float* amax,
                                                            float* partial_sums, __nv_fp8_interpretation_t format) {
  using P = Pack<T, 16 / sizeof(T)>;
  constexpr int kPerPack = 16 / sizeof(T), kPacks = kChunk / kPerPack;
  // Two tiles' codes, taken in turns: a tile's codes are written while
  // the tile before's transpose may still be read from the other one.
  __shared__ alignas(16) Fp8TileCodes codes_of[2];
  // The values of one tile, for its column sums (each column summed
  // by one thread in row order: the same bits every run).
  __shared__ float values[kSums ? kTile : 1][kTile + 1];
  const float scale = *scale_ptr;
  const int64_t col_tiles = (cols + kTile - 1) / kTile, count = col_tiles * ((rows + kTile - 1) / kTile);
  const int64_t stride = gridDim.x;
  const int r = threadIdx.x / (kTile / kChunk), c = (threadIdx.x % (kTile / kChunk)) * kChunk;
  auto row0_of = [&](int64_t tile) { return tile / col_tiles * kTile; };
  auto col0_of = [&](int64_t tile) { return tile % col_tiles * kTile; };
  auto inside = [&](int64_t tile) { return row0_of(tile) + r < rows && col0_of(tile) + c < cols; };
  auto at = [&](int64_t tile) { return (row0_of(tile) + r) * cols + col0_of(tile) + c; };
  P packs[2][kPacks], aux_packs[2][kPacks];
  auto load = [&](int64_t tile, P(&to)[kPacks], P(&aux_to)[kPacks]) {
    if (tile >= count || !inside(tile)) return;
#pragma unroll
    for (int p = 0; p < kPacks; ++p) to[p] = reinterpret_cast<const P*>(in + at(tile))[p];
    if (aux) {
#pragma unroll
      for (int p = 0; p < kPacks; ++p) aux_to[p] = reinterpret_cast<const P*>(aux + at(tile))[p];
    }
  };
  uint32_t bits = 0;
  auto quantize = [&](int64_t tile, const P(&from)[kPacks], const P(&aux_from)[kPacks], Fp8TileCodes& codes_tile) {
    const int64_t row0 = row0_of(tile), col0 = col0_of(tile);
    if (inside(tile)) {
      Pack<uint8_t, kChunk> codes;
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        const float v =
            prologue_value(prologue, from[i / kPerPack].v[i % kPerPack], aux ? aux_from[i / kPerPack].v[i % kPerPack] : T{});
        bits = max(bits, abs_bits(v));
        codes.v[i] = to_fp8(v * scale, format);
        if constexpr (kSums) values[r][c + i] = v;
      }
      *reinterpret_cast<Pack<uint8_t, kChunk>*>(out + at(tile)) = codes;
      if (out_t) *reinterpret_cast<Pack<uint8_t, kChunk>*>(&codes_tile[r][c]) = codes;
    } else if constexpr (kSums) {
#pragma unroll
      for (int i = 0; i < kChunk; ++i) values[r][c + i] = 0.0f;
    }
    if (out_t || kSums) __syncthreads();
    if (out_t) store_transposed_chunk(codes_tile, r, c, row0, col0, rows, cols, out_t);
    if constexpr (kSums) {
      if (threadIdx.x < kTile && col0 + threadIdx.x < cols) {
        float sum = 0.0f;
        for (int i = 0; i < kTile; ++i) sum += values[i][threadIdx.x];
        partial_sums[row0 / kTile * cols + col0 + threadIdx.x] = sum;
      }
      __syncthreads();  // before the next tile's values
    }
  };
  // Unrolled by two, so that each tile's registers have fixed names.
  int64_t tile = blockIdx.x;
  load(tile, packs[0], aux_packs[0]);
  for (; tile < count; tile += 2 * stride) {
    load(tile + stride, packs[1], aux_packs[1]);
    quantize(tile, packs[0], aux_packs[0], codes_of[0]);
    if (tile + stride >= count) break;
    load(tile + 2 * stride, packs[0], aux_packs[0]);
    quantize(tile + stride, packs[1], aux_packs[1], codes_of[1]);
  }
  if (amax) block_amax(bits, amax);
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = 1.0f / scale;
}

// Blocks of quantize_tiles<T, kSums> that fit on the GPU at once.
template <typename T, bool kSums>
int64_t resident_quantize_blocks(const Launch& l) {
  static const int per_sm = [] {
    int n = 0;
    MPT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, quantize_tiles<T, kSums>, kThreads, 0));
    return std::max(n, 1);
  }();
  return static_cast<int64_t>(per_sm) * l.sm_count;
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
    const int64_t tile_count = (rows + kTile - 1) / kTile * ((cols + kTile - 1) / kTile);
    const bool tiles = rows % kChunk == 0 && cols % kChunk == 0 && aligned16(in) && aligned16(out) &&
                       (!out_t || aligned16(out_t)) && (!aux || aligned16(aux));
    if (tiles) {
      if (partial_sums) {
        const auto grid = static_cast<unsigned>(std::min(tile_count, resident_quantize_blocks<T, true>(l)));
        quantize_tiles<T, true><<<grid, kThreads, 0, l.stream>>>(in, aux, q.prologue, out, out_t, rows, cols, scale,
                                                                 scale_inv, amax, partial_sums, format);
      } else {
        const auto grid = static_cast<unsigned>(std::min(tile_count, resident_quantize_blocks<T, false>(l)));
        quantize_tiles<T, false><<<grid, kThreads, 0, l.stream>>>(in, aux, q.prologue, out, out_t, rows, cols, scale,
                                                                  scale_inv, amax, nullptr, format);
      }
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
