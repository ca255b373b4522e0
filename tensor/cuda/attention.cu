// Fused scaled-dot-product attention for f16/bf16 on tensor cores (WMMA),
// in the manner of FlashAttention-2: scores never reach global memory.
//
// Forward: a block takes 64 queries of one (batch, head); each of its four
// warps owns 16 of them. Key/value tiles of 64 rows stream through shared
// memory; a warp computes its 16x64 scores with WMMA, keeps a running row
// maximum and sum (the online softmax, in base 2), rescales its output
// accumulator and adds P·V. It writes the output and the log-sum-exp of
// each row, which is all the backward pass needs to rebuild P.
//
// Backward: a block takes 64 keys; its warps own 16 each and keep their dK
// and dV in WMMA accumulators while query tiles stream past. Per tile it
// rebuilds P^T from the saved log-sum-exp, forms dS = P (dP - delta) with
// delta = rowsum(dO * O) (a small kernel first), accumulates dV += P^T dO
// and dK += dS^T Q, and adds its share of dQ = dS K to an f32 buffer with
// atomics (dQ is summed over key blocks).
//
// Scores, softmax and all accumulations are f32; P and dS are rounded to the
// input type for the tensor-core products, as in FlashAttention.
#include <mma.h>

#include <atomic>

#include "tensor/cuda/attention.h"
#include "tensor/cuda/kernel_utils.cuh"

namespace mpt::cuda {
namespace {

using namespace nvcuda;

constexpr int kTile = 64;   // queries per forward block, keys per backward block
constexpr int kWarps = 4;   // 16 rows each
constexpr int kBlockThreads = kWarps * 32;
constexpr int kPad16 = 8;   // row padding (elements) of 16-bit tiles: spreads banks, keeps 32-byte alignment
constexpr int kPad32 = 4;   // row padding of f32 tiles
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <typename T>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
template <typename T>
using FragAt = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major>;
template <typename T>
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
template <typename T>
using FragBt = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

template <typename T>
__device__ __forceinline__ T to(float x);
template <>
__device__ __forceinline__ __half to<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 to<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
__device__ __forceinline__ float from(__half x) { return __half2float(x); }
__device__ __forceinline__ float from(__nv_bfloat16 x) { return __bfloat162float(x); }

// Rows [row0, row0 + 64) of a [rows, D] matrix into a padded shared tile,
// 16 bytes at a time; rows past the end are zero.
template <typename T, int D>
__device__ __forceinline__ void load_tile(T* tile, const T* src, int row0, int rows) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kPerRow = D / kVec;
  for (int i = threadIdx.x; i < kTile * kPerRow; i += kBlockThreads) {
    const int r = i / kPerRow, c = (i % kPerRow) * kVec;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (row0 + r < rows) value = *reinterpret_cast<const uint4*>(src + static_cast<int64_t>(row0 + r) * D + c);
    *reinterpret_cast<uint4*>(tile + r * (D + kPad16) + c) = value;
  }
}

// out (16 x 16·N, f32, ld_out) = a (16 x K) · b (K x 16·N), b given as its
// transpose (rows of b^T = columns of b, as K and Q tiles are stored).
template <typename T, int K, int N>
__device__ __forceinline__ void product_abt(float* out, int ld_out, const T* a, int lda, const T* bt, int ldb) {
#pragma unroll
  for (int n = 0; n < N; ++n) {
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
#pragma unroll
    for (int k = 0; k < K / 16; ++k) {
      FragA<T> fa;
      FragBt<T> fb;
      wmma::load_matrix_sync(fa, a + k * 16, lda);
      wmma::load_matrix_sync(fb, bt + n * 16 * ldb + k * 16, ldb);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(out + n * 16, acc, ld_out, wmma::mem_row_major);
  }
}

template <typename T, int D>
struct ForwardLayout {
  static constexpr int ld = D + kPad16;
  static constexpr int ld_s = kTile + kPad32;
  static constexpr int ld_p = kTile + kPad16;
  static constexpr int ld_o = D + kPad32;
  static constexpr size_t q = 0;
  static constexpr size_t k = q + kTile * ld * sizeof(T);
  static constexpr size_t v = k + kTile * ld * sizeof(T);
  static constexpr size_t s = v + kTile * ld * sizeof(T);
  static constexpr size_t p = s + kWarps * 16 * ld_s * sizeof(float);
  static constexpr size_t o = p + kWarps * 16 * ld_p * sizeof(T);
  static constexpr size_t bytes = o + kWarps * 16 * ld_o * sizeof(float);
};

template <typename T, int D>
__global__ void __launch_bounds__(kBlockThreads)
    attention_forward_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                             T* __restrict__ out, float* __restrict__ lse, int len, float scale_log2, bool causal) {
  using L = ForwardLayout<T, D>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem + L::q);
  T* sK = reinterpret_cast<T*>(smem + L::k);
  T* sV = reinterpret_cast<T*>(smem + L::v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* sS = reinterpret_cast<float*>(smem + L::s) + warp * 16 * L::ld_s;
  T* sP = reinterpret_cast<T*>(smem + L::p) + warp * 16 * L::ld_p;
  float* sO = reinterpret_cast<float*>(smem + L::o) + warp * 16 * L::ld_o;

  const int q0 = blockIdx.x * kTile;
  const int64_t head = static_cast<int64_t>(blockIdx.y) * len * D;
  load_tile<T, D>(sQ, q + head, q0, len);
  for (int i = lane; i < 16 * D; i += 32) sO[(i / D) * L::ld_o + i % D] = 0.0f;

  // Two lanes share a row: lane/2 is the row, lane%2 the half of the columns.
  const int row = lane >> 1, half = lane & 1;
  const int q_index = q0 + warp * 16 + row;
  float m = -INFINITY, l = 0.0f;
  const int tiles = (len + kTile - 1) / kTile;
  const int kv_tiles = causal ? min(static_cast<int>(blockIdx.x) + 1, tiles) : tiles;
  for (int j = 0; j < kv_tiles; ++j) {
    __syncthreads();  // everyone is done with the previous K, V
    load_tile<T, D>(sK, k + head, j * kTile, len);
    load_tile<T, D>(sV, v + head, j * kTile, len);
    __syncthreads();
    product_abt<T, D, kTile / 16>(sS, L::ld_s, sQ + warp * 16 * L::ld, L::ld, sK, L::ld);
    __syncwarp();

    // Online softmax over this tile, in base 2.
    float s[32];
    float tile_max = -INFINITY;
    const int key0 = j * kTile + half * 32;
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      const int key = key0 + c;
      const bool masked = key >= len || (causal && key > q_index);
      s[c] = masked ? -INFINITY : sS[row * L::ld_s + half * 32 + c] * scale_log2;
      tile_max = fmaxf(tile_max, s[c]);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    const float m_new = fmaxf(m, tile_max);
    const float base = m_new == -INFINITY ? 0.0f : m_new;  // a fully masked row stays all zero
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      const float p = exp2f(s[c] - base);
      sum += p;
      sP[row * L::ld_p + half * 32 + c] = to<T>(p);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    const float alpha = exp2f(m - base);
    l = l * alpha + sum;
    m = m_new;
    for (int d = half * (D / 2); d < (half + 1) * (D / 2); ++d) sO[row * L::ld_o + d] *= alpha;
    __syncwarp();

    // O += P V
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
      FragC acc;
      wmma::load_matrix_sync(acc, sO + n * 16, L::ld_o, wmma::mem_row_major);
#pragma unroll
      for (int kk = 0; kk < kTile / 16; ++kk) {
        FragA<T> fa;
        FragB<T> fb;
        wmma::load_matrix_sync(fa, sP + kk * 16, L::ld_p);
        wmma::load_matrix_sync(fb, sV + kk * 16 * L::ld + n * 16, L::ld);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(sO + n * 16, acc, L::ld_o, wmma::mem_row_major);
    }
    __syncwarp();
  }

  if (q_index < len) {
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    T* dst = out + head + static_cast<int64_t>(q_index) * D;
    for (int d = half * (D / 2); d < (half + 1) * (D / 2); ++d) dst[d] = to<T>(sO[row * L::ld_o + d] * inv);
    if (half == 0) lse[static_cast<int64_t>(blockIdx.y) * len + q_index] = (m + log2f(l)) * kLn2;
  }
}

// delta[row] = sum_d dO[row, d] * O[row, d]: one warp per row.
template <typename T, int D>
__global__ void attention_delta_kernel(const T* __restrict__ grad_out, const T* __restrict__ out,
                                       float* __restrict__ delta, int64_t rows) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  float acc = 0.0f;
  for (int d = lane; d < D; d += 32) acc += from(grad_out[row * D + d]) * from(out[row * D + d]);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) delta[row] = acc;
}

template <typename T, int D>
struct BackwardLayout {
  static constexpr int ld = D + kPad16;
  static constexpr int ld_s = kTile + kPad32;
  static constexpr int ld_p = kTile + kPad16;
  static constexpr int ld_x = (D > kTile ? D : kTile) + kPad32;
  static constexpr size_t k = 0;
  static constexpr size_t v = k + kTile * ld * sizeof(T);
  static constexpr size_t q = v + kTile * ld * sizeof(T);
  static constexpr size_t dout = q + kTile * ld * sizeof(T);
  static constexpr size_t s = dout + kTile * ld * sizeof(T);
  static constexpr size_t dp = s + kWarps * 16 * ld_s * sizeof(float);
  static constexpr size_t p = dp + kWarps * 16 * ld_s * sizeof(float);
  static constexpr size_t ds = p + kWarps * 16 * ld_p * sizeof(T);
  static constexpr size_t lse = ds + kTile * ld_p * sizeof(T);
  static constexpr size_t delta = lse + kTile * sizeof(float);
  static constexpr size_t scratch = delta + kTile * sizeof(float);
  static constexpr size_t bytes = scratch + kWarps * 16 * ld_x * sizeof(float);
};

template <typename T, int D>
__global__ void __launch_bounds__(kBlockThreads)
    attention_backward_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                              const T* __restrict__ grad_out, const float* __restrict__ lse,
                              const float* __restrict__ delta, float* __restrict__ grad_q, T* __restrict__ grad_k,
                              T* __restrict__ grad_v, int len, float scale, bool causal) {
  using L = BackwardLayout<T, D>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem + L::k);
  T* sV = reinterpret_cast<T*>(smem + L::v);
  T* sQ = reinterpret_cast<T*>(smem + L::q);
  T* sdO = reinterpret_cast<T*>(smem + L::dout);
  T* sdS = reinterpret_cast<T*>(smem + L::ds);  // dS^T of all 64 keys x 64 queries
  float* sLse = reinterpret_cast<float*>(smem + L::lse);
  float* sDelta = reinterpret_cast<float*>(smem + L::delta);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* sS = reinterpret_cast<float*>(smem + L::s) + warp * 16 * L::ld_s;
  float* sdP = reinterpret_cast<float*>(smem + L::dp) + warp * 16 * L::ld_s;
  T* sP = reinterpret_cast<T*>(smem + L::p) + warp * 16 * L::ld_p;
  float* scratch = reinterpret_cast<float*>(smem + L::scratch) + warp * 16 * L::ld_x;

  const int k0 = blockIdx.x * kTile;
  const int64_t bh = blockIdx.y;
  const int64_t head = bh * len * D;
  load_tile<T, D>(sK, k + head, k0, len);
  load_tile<T, D>(sV, v + head, k0, len);

  FragC dk[D / 16], dv[D / 16];
#pragma unroll
  for (int n = 0; n < D / 16; ++n) {
    wmma::fill_fragment(dk[n], 0.0f);
    wmma::fill_fragment(dv[n], 0.0f);
  }
  const int row = lane >> 1, half = lane & 1;
  const int k_index = k0 + warp * 16 + row;
  const float scale_log2 = scale * kLog2e;
  const int tiles = (len + kTile - 1) / kTile;
  for (int i = causal ? blockIdx.x : 0; i < tiles; ++i) {
    const int q0 = i * kTile;
    __syncthreads();  // the previous tile's Q, dO, dS are no longer read
    load_tile<T, D>(sQ, q + head, q0, len);
    load_tile<T, D>(sdO, grad_out + head, q0, len);
    for (int r = threadIdx.x; r < kTile; r += kBlockThreads) {
      const bool valid = q0 + r < len;
      sLse[r] = valid ? lse[bh * len + q0 + r] * kLog2e : INFINITY;
      sDelta[r] = valid ? delta[bh * len + q0 + r] : 0.0f;
    }
    __syncthreads();

    // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys.
    product_abt<T, D, kTile / 16>(sS, L::ld_s, sK + warp * 16 * L::ld, L::ld, sQ, L::ld);
    product_abt<T, D, kTile / 16>(sdP, L::ld_s, sV + warp * 16 * L::ld, L::ld, sdO, L::ld);
    __syncwarp();
#pragma unroll 4
    for (int c = 0; c < 32; ++c) {
      const int col = half * 32 + c, q_index = q0 + col;
      const bool valid = q_index < len && k_index < len && !(causal && k_index > q_index);
      const float p = valid ? exp2f(sS[row * L::ld_s + col] * scale_log2 - sLse[col]) : 0.0f;
      const float ds = p * (sdP[row * L::ld_s + col] - sDelta[col]) * scale;
      sP[row * L::ld_p + col] = to<T>(p);
      sdS[(warp * 16 + row) * L::ld_p + col] = to<T>(ds);
    }
    __syncwarp();

    // dV += P^T dO, dK += dS^T Q (this warp's rows of P^T and dS^T).
#pragma unroll
    for (int n = 0; n < D / 16; ++n)
#pragma unroll
      for (int kk = 0; kk < kTile / 16; ++kk) {
        FragA<T> fp, fds;
        FragB<T> fdo, fq;
        wmma::load_matrix_sync(fp, sP + kk * 16, L::ld_p);
        wmma::load_matrix_sync(fdo, sdO + kk * 16 * L::ld + n * 16, L::ld);
        wmma::mma_sync(dv[n], fp, fdo, dv[n]);
        wmma::load_matrix_sync(fds, sdS + warp * 16 * L::ld_p + kk * 16, L::ld_p);
        wmma::load_matrix_sync(fq, sQ + kk * 16 * L::ld + n * 16, L::ld);
        wmma::mma_sync(dk[n], fds, fq, dk[n]);
      }
    __syncthreads();  // all of dS^T is written

    // dQ (this warp's 16 queries) += dS K, with dS read transposed from dS^T.
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
      FragC acc;
      wmma::fill_fragment(acc, 0.0f);
#pragma unroll
      for (int kk = 0; kk < kTile / 16; ++kk) {
        FragAt<T> fds;
        FragB<T> fk;
        wmma::load_matrix_sync(fds, sdS + kk * 16 * L::ld_p + warp * 16, L::ld_p);
        wmma::load_matrix_sync(fk, sK + kk * 16 * L::ld + n * 16, L::ld);
        wmma::mma_sync(acc, fds, fk, acc);
      }
      wmma::store_matrix_sync(scratch + n * 16, acc, L::ld_x, wmma::mem_row_major);
    }
    __syncwarp();
    for (int e = lane; e < 16 * D; e += 32) {
      const int r = e / D, d = e % D, q_index = q0 + warp * 16 + r;
      if (q_index < len) atomicAdd(grad_q + head + static_cast<int64_t>(q_index) * D + d, scratch[r * L::ld_x + d]);
    }
  }

  // Write this warp's dK and dV rows.
  for (int which = 0; which < 2; ++which) {
    __syncwarp();
#pragma unroll
    for (int n = 0; n < D / 16; ++n)
      wmma::store_matrix_sync(scratch + n * 16, which == 0 ? dk[n] : dv[n], L::ld_x, wmma::mem_row_major);
    __syncwarp();
    T* dst = which == 0 ? grad_k : grad_v;
    for (int e = lane; e < 16 * D; e += 32) {
      const int r = e / D, d = e % D, key = k0 + warp * 16 + r;
      if (key < len) dst[head + static_cast<int64_t>(key) * D + d] = to<T>(scratch[r * L::ld_x + d]);
    }
  }
}

// Raises a kernel's dynamic shared memory limit above the default 48 KiB,
// once per device (the attribute is per device); `done` is the kernel's own
// record of the devices already set.
template <typename Kernel>
void allow_shared_memory(Kernel kernel, size_t bytes, int device, std::atomic<uint64_t>& done) {
  const uint64_t bit = uint64_t(1) << (device % 64);
  if (done.load(std::memory_order_acquire) & bit) return;
  MPT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  done.fetch_or(bit, std::memory_order_acq_rel);
}

template <typename T, int D>
void forward_typed(const Launch& l, const AttentionArgs& a) {
  using L = ForwardLayout<T, D>;
  auto kernel = attention_forward_kernel<T, D>;
  static std::atomic<uint64_t> devices_set{0};
  allow_shared_memory(kernel, L::bytes, l.device, devices_set);
  const dim3 grid((a.len + kTile - 1) / kTile, static_cast<unsigned>(a.batch_heads));
  kernel<<<grid, kBlockThreads, L::bytes, l.stream>>>(
      static_cast<const T*>(a.q), static_cast<const T*>(a.k), static_cast<const T*>(a.v), static_cast<T*>(a.out),
      a.lse, a.len, static_cast<float>(a.scale) * kLog2e, a.causal);
  MPT_CUDA_CHECK_LAUNCH("attention_forward_kernel");
}

template <typename T, int D>
void backward_typed(const Launch& l, const AttentionArgs& a, const AttentionGrads& g) {
  const int64_t rows = a.batch_heads * a.len;
  attention_delta_kernel<T, D><<<static_cast<unsigned>((rows * 32 + 255) / 256), 256, 0, l.stream>>>(
      static_cast<const T*>(g.grad_out), static_cast<const T*>(a.out), g.delta, rows);
  MPT_CUDA_CHECK_LAUNCH("attention_delta_kernel");
  using L = BackwardLayout<T, D>;
  auto kernel = attention_backward_kernel<T, D>;
  static std::atomic<uint64_t> devices_set{0};
  allow_shared_memory(kernel, L::bytes, l.device, devices_set);
  const dim3 grid((a.len + kTile - 1) / kTile, static_cast<unsigned>(a.batch_heads));
  kernel<<<grid, kBlockThreads, L::bytes, l.stream>>>(
      static_cast<const T*>(a.q), static_cast<const T*>(a.k), static_cast<const T*>(a.v),
      static_cast<const T*>(g.grad_out), a.lse, g.delta, g.grad_q, static_cast<T*>(g.grad_k),
      static_cast<T*>(g.grad_v), a.len, static_cast<float>(a.scale), a.causal);
  MPT_CUDA_CHECK_LAUNCH("attention_backward_kernel");
}

template <typename F>
void dispatch(DType dtype, int64_t head_dim, F&& f) {
  auto by_dim = [&](auto tag) {
    using T = decltype(tag);
    switch (head_dim) {
      case 32: return f.template operator()<T, 32>();
      case 64: return f.template operator()<T, 64>();
      case 128: return f.template operator()<T, 128>();
      default: throw_dtype_unsupported("fused attention (head size 32, 64 or 128)", dtype);
    }
  };
  switch (dtype) {
    case DType::f16: return by_dim(__half{});
    case DType::bf16: return by_dim(__nv_bfloat16{});
    default: throw_dtype_unsupported("fused attention", dtype);
  }
}

}  // namespace

bool fused_attention_supported(DType dtype, int64_t head_dim) {
  return (dtype == DType::f16 || dtype == DType::bf16) && (head_dim == 32 || head_dim == 64 || head_dim == 128);
}

void launch_attention_forward(const Launch& l, const AttentionArgs& a) {
  if (a.len == 0 || a.batch_heads == 0) return;
  dispatch(a.dtype, a.head_dim, [&]<typename T, int D>() { forward_typed<T, D>(l, a); });
}

void launch_attention_backward(const Launch& l, const AttentionArgs& a, const AttentionGrads& g) {
  if (a.len == 0 || a.batch_heads == 0) return;
  dispatch(a.dtype, a.head_dim, [&]<typename T, int D>() { backward_typed<T, D>(l, a, g); });
}

}  // namespace mpt::cuda
