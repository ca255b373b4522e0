// Fused scaled-dot-product attention for f16/bf16 on tensor cores, in the
// manner of FlashAttention-2: scores never reach global memory, and the
// scores, probabilities and accumulators of a warp stay in its registers
// (mma.sync m16n8k16 with ldmatrix from shared memory).
//
// Forward: a block takes 64 queries of one (batch, head); each of its four
// warps owns 16 of them. Key/value tiles of 64 rows stream through shared
// memory, the next one loading (cp.async) while the current one is used. A
// warp computes its 16x64 scores, keeps a running row maximum and sum (the
// online softmax, in base 2), rescales its output accumulator and adds P·V,
// with P handed from the score accumulators to the next product's operand
// registers without a trip through memory. It writes the output and the
// log-sum-exp of each row, which is all the backward pass needs.
//
// Backward: two kernels that each rebuild P from the saved log-sum-exp and
// form dS = P (dP - delta), delta being rowsum(dO * O). The first takes 64
// queries a block, as the forward pass does, works out its rows' delta
// (and writes it for the second), and keeps dQ in registers while key
// tiles stream past: dQ += dS K. The second takes 64 keys a block (16 a
// warp) and keeps dK and dV in registers while query tiles stream past:
// dV += P^T dO, dK += dS^T Q. Each gradient is written once, in the input
// type.
//
// Operands are addressed through AttentionLayout, so q, k and v can be read
// where a fused [B, T, 3C] projection left them and the output written as
// [B, T, H, D], with no transposing copies.
//
// Scores, softmax and all accumulations are f32; P and dS are rounded to the
// input type for the tensor-core products, as in FlashAttention.
#include <atomic>
#include <cstring>
#include <type_traits>

#include "tensor/cuda/attention.h"
#include "tensor/cuda/kernel_utils.cuh"

namespace mpt::cuda {
namespace {

constexpr int kTile = 64;   // queries per forward block, keys per backward block, rows per streamed tile
constexpr int kWarps = 4;   // 16 rows each
constexpr int kBlockThreads = kWarps * 32;
constexpr int kPad = 8;     // row padding (elements): ldmatrix's eight rows fall in distinct banks
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Two floats rounded to T and packed in one register, the first in the low
// half: the layout of mma.sync's 16-bit operands.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  const T l = Element<T>::store(lo), h = Element<T>::store(hi);
  uint16_t lo_bits, hi_bits;
  memcpy(&lo_bits, &l, sizeof lo_bits);
  memcpy(&hi_bits, &h, sizeof hi_bits);
  return static_cast<uint32_t>(lo_bits) | (static_cast<uint32_t>(hi_bits) << 16);
}

// d += a (16x16, row) · b (16x8, col) on tensor cores, f32 accumulators;
// `type` is the inputs' PTX type. Not volatile: a pure function of its
// registers, which the compiler may interleave with other work.
#define MPT_MMA_M16N8K16(type)                                                                     \
  asm("mma.sync.aligned.m16n8k16.row.col.f32." type "." type ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, " \
      "{%8,%9}, {%0,%1,%2,%3};\n"                                                                  \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                             \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))

template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) MPT_MMA_M16N8K16("f16");
  else MPT_MMA_M16N8K16("bf16");
}
#undef MPT_MMA_M16N8K16

// 2^x by the special-function unit alone, results below 2^-126 flushed to
// zero. exp2f wraps the same instruction in a rescaling for such results,
// three more instructions an exponent; a probability that small is zero
// once rounded to 16 bits, and a sum of them changes nothing.
__device__ __forceinline__ float exp2_flush(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Two (four) 8x8 matrices of 16-bit elements; lane i names a row of matrix i / 8.
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(shared_address(row)));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
}

// Fragment loads from a row-major shared tile with leading dimension `ld`.
// A (16x16 at rows r0, columns c0) of a tile stored as A itself.
template <typename T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* tile, int ld, int r0, int c0, int lane) {
  ldmatrix_x4(a, tile + (r0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + c0 + (lane >> 4) * 8);
}
// A (16x16) of a tile stored transposed: A[m][k] = tile[k0 + k][m0 + m].
template <typename T>
__device__ __forceinline__ void load_a_transposed(uint32_t (&a)[4], const T* tile, int ld, int m0, int k0, int lane) {
  ldmatrix_x4_trans(a, tile + (k0 + (lane & 7) + (lane >> 4) * 8) * ld + m0 + ((lane >> 3) & 1) * 8);
}
// B operands of one k-step (k0) for one 8-wide n-tile, from a tile stored
// as B^T (rows are n, as K rows are for S = Q K^T).
template <typename T>
__device__ __forceinline__ void load_b_from_rows_of_bt(uint32_t (&b)[2], const T* tile, int ld, int n0, int k0,
                                                       int lane) {
  ldmatrix_x2(b, tile + (n0 + (lane & 7)) * ld + k0 + ((lane >> 3) & 1) * 8);
}
// B operands of one k-step for two n-tiles (n0 and n0 + 8), from a tile
// stored as B (rows are k, as V rows are for O = P V):
// {b[0], b[1]} for n0, {b[2], b[3]} for n0 + 8.
template <typename T>
__device__ __forceinline__ void load_b_from_rows_of_b(uint32_t (&b)[4], const T* tile, int ld, int k0, int n0,
                                                      int lane) {
  ldmatrix_x4_trans(b, tile + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + n0 + (lane >> 4) * 8);
}

// acc (16 x 8·N) += a (one 16 x 16 k-step, in registers) · b, with b given
// as columns [k0, k0 + 16) of the rows of b^T (tile_bt, N·8 rows). The N
// products are independent, so none waits for the one before.
template <typename T, int N>
__device__ __forceinline__ void product_abt_step(float (&acc)[N][4], const uint32_t (&a)[4], const T* tile_bt, int ld,
                                                 int k0, int lane) {
#pragma unroll
  for (int n = 0; n < N; ++n) {
    uint32_t b[2];
    load_b_from_rows_of_bt(b, tile_bt, ld, n * 8, k0, lane);
    mma<T>(acc[n], a, b[0], b[1]);
  }
}

// acc (16 x 8·N) += a (16 x K, rows r0 of tile_a) · b, with b given as the
// rows of b^T (tile_bt, N·8 rows of K).
template <typename T, int K, int N>
__device__ __forceinline__ void product_abt(float (&acc)[N][4], const T* tile_a, int r0, const T* tile_bt, int ld,
                                            int lane) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t a[4];
    load_a(a, tile_a, ld, r0, kk * 16, lane);
    product_abt_step<T, N>(acc, a, tile_bt, ld, kk * 16, lane);
  }
}

// Calls f(n, e, row, column) for each element of a thread's share of 16 x
// 8·N accumulators: element (n, e) is row row_lo + 8 (e / 2) and column
// column_lo + 8n + e % 2 (the lane's offsets included in both). Masks are
// applied this way only to the tiles that need them (the causal
// diagonal, the end of the sequence), each tile-uniform flag on its own.
template <int N, typename F>
__device__ __forceinline__ void for_each_element(int row_lo, int column_lo, F&& f) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) f(n, e, row_lo + (e >> 1) * 8, column_lo + n * 8 + (e & 1));
}

// The maximum and the sum of row half h (elements e = 2h, 2h + 1) of a
// thread's share of 16 x 8·N score accumulators, as trees: a chain of 2N
// dependent operations would stall on each.
template <int N>
__device__ __forceinline__ float row_half_max(const float (&s)[N][4], int h) {
  float v[N];
#pragma unroll
  for (int n = 0; n < N; ++n) v[n] = fmaxf(s[n][2 * h], s[n][2 * h + 1]);
#pragma unroll
  for (int w = N / 2; w > 0; w /= 2)
#pragma unroll
    for (int i = 0; i < w; ++i) v[i] = fmaxf(v[i], v[i + w]);
  return v[0];
}
template <int N>
__device__ __forceinline__ float row_half_sum(const float (&s)[N][4], int h) {
  float v[N];
#pragma unroll
  for (int n = 0; n < N; ++n) v[n] = s[n][2 * h] + s[n][2 * h + 1];
#pragma unroll
  for (int w = N / 2; w > 0; w /= 2)
#pragma unroll
    for (int i = 0; i < w; ++i) v[i] += v[i + w];
  return v[0];
}

// acc (16 x D) += p (16 x 64, as score accumulators: 8 n-tiles) · tile_b
// (64 rows of D): the accumulators of two adjacent n-tiles are exactly the
// A operand of one 16-wide k-step.
template <typename T, int D>
__device__ __forceinline__ void product_pb(float (&acc)[D / 8][4], const float (&p)[kTile / 8][4], const T* tile_b,
                                           int ld, int lane) {
#pragma unroll
  for (int kk = 0; kk < kTile / 16; ++kk) {
    const uint32_t a[4] = {pack2<T>(p[2 * kk][0], p[2 * kk][1]), pack2<T>(p[2 * kk][2], p[2 * kk][3]),
                           pack2<T>(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                           pack2<T>(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
      uint32_t b[4];
      load_b_from_rows_of_b(b, tile_b, ld, kk * 16, n * 16, lane);
      mma<T>(acc[2 * n], a, b[0], b[1]);
      mma<T>(acc[2 * n + 1], a, b[2], b[3]);
    }
  }
}

// Starts copying rows [row0, row0 + 64) of an operand into a padded shared
// tile, 16 bytes per cp.async; rows past the end are zero-filled.
template <typename T, int D>
__device__ __forceinline__ void load_tile_async(T* tile, const T* src, int64_t row_stride, int row0, int rows) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kPerRow = D / kVec;                      // 16-byte pieces a row
  constexpr int kRowsPerPass = kBlockThreads / kPerRow;  // rows the block starts at once
  static_assert(kBlockThreads % kPerRow == 0 && kTile % kRowsPerPass == 0);
  // A thread's piece is the same column in every pass: its addresses are
  // computed once, and the passes unroll to fixed offsets.
  const int r = threadIdx.x / kPerRow, c = (threadIdx.x % kPerRow) * kVec;
  const T* from = src + (row0 + r) * row_stride + c;
  T* to = tile + r * (D + kPad) + c;
#pragma unroll
  for (int pass = 0; pass < kTile / kRowsPerPass; ++pass) {
    const bool inside = row0 + r + pass * kRowsPerPass < rows;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                     shared_address(to + pass * kRowsPerPass * (D + kPad))),
                 "l"(inside ? from + pass * kRowsPerPass * row_stride : src), "r"(inside ? 16 : 0));
  }
}
// Starts copying floats [row0, row0 + 64) of a per-row vector into shared
// memory, 4 bytes per cp.async; rows past the end are zero-filled.
__device__ __forceinline__ void load_row_values_async(float* dst, const float* src, int row0, int rows) {
  static_assert(kBlockThreads >= kTile);
  if (const int r = threadIdx.x; r < kTile) {
    const bool inside = row0 + r < rows;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(shared_address(dst + r)),
                 "l"(inside ? src + row0 + r : src), "r"(inside ? 4 : 0));
  }
}
__device__ __forceinline__ void async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <typename T>
__device__ __forceinline__ const T* head_of(const void* base, const AttentionLayout& l, int64_t bh, int64_t heads) {
  return static_cast<const T*>(base) + (bh / heads) * l.batch + (bh % heads) * l.head;
}

// Grid: blockIdx.x is the (batch, head), blockIdx.y the tile of 64 rows.
// Under the causal mask the blocks' work differs by up to the number of
// tiles; blocks start in the order of their linear index, so numbering
// the longest first leaves the short ones to fill the last wave.
// Query blocks (forward, dQ) see more key tiles the later their queries;
// key blocks (dK, dV) see more query tiles the earlier their keys.
__device__ __forceinline__ int query_tile_of_block() { return static_cast<int>(gridDim.y - 1 - blockIdx.y); }
__device__ __forceinline__ int key_tile_of_block() { return static_cast<int>(blockIdx.y); }

// The rows of q, k and v of one (batch, head), blockIdx.x's.
template <typename T>
struct HeadOperands {
  const T* q;
  const T* k;
  const T* v;
  __device__ HeadOperands(const AttentionArgs& a, int64_t bh)
      : q(head_of<T>(a.q, a.q_layout, bh, a.heads)),
        k(head_of<T>(a.k, a.k_layout, bh, a.heads)),
        v(head_of<T>(a.v, a.v_layout, bh, a.heads)) {}
};

// Key/value tile j of `tiles` streaming through two buffers of shared
// memory: starts loading tile j + 1 into the other buffer, then waits for
// tile j (loaded by the call before, or with the prologue's group) and
// for every thread of the block.
template <typename T, int D>
__device__ __forceinline__ void next_key_value_tile(T* sK, T* sV, const HeadOperands<T>& h, const AttentionArgs& a,
                                                    int j, int tiles) {
  constexpr int kTileElems = kTile * (D + kPad);
  if (j + 1 < tiles) {
    const int next = (j + 1) & 1;
    load_tile_async<T, D>(sK + next * kTileElems, h.k, a.k_layout.row, (j + 1) * kTile, a.len);
    load_tile_async<T, D>(sV + next * kTileElems, h.v, a.v_layout.row, (j + 1) * kTile, a.len);
    async_commit();
    async_wait<1>();
  } else {
    async_wait<0>();
  }
  __syncthreads();
}

// Writes a 16 x D accumulator (rows r0 + g and r0 + g + 8) as T, two elements per store.
template <typename T, int D>
__device__ __forceinline__ void store_rows(T* dst, int64_t row_stride, int r0, int rows, const float (&acc)[D / 8][4],
                                           float scale_lo, float scale_hi, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = r0 + g + half * 8;
    if (r >= rows) continue;
    const float s = half ? scale_hi : scale_lo;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<uint32_t*>(dst + r * row_stride + n * 8 + 2 * t) =
          pack2<T>(acc[n][2 * half] * s, acc[n][2 * half + 1] * s);
  }
}

template <typename T, int D>
struct ForwardLayout {
  static constexpr int ld = D + kPad;
  static constexpr size_t tile = size_t(kTile) * ld * sizeof(T);
  static constexpr size_t q = 0;
  static constexpr size_t k = q + tile;      // two buffers
  static constexpr size_t v = k + 2 * tile;  // two buffers
  static constexpr size_t bytes = v + 2 * tile;
};

template <typename T, int D>
__global__ void __launch_bounds__(kBlockThreads)
    attention_forward_kernel(AttentionArgs a, float scale_log2) {
  using L = ForwardLayout<T, D>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem + L::q);
  T* sK = reinterpret_cast<T*>(smem + L::k);
  T* sV = reinterpret_cast<T*>(smem + L::v);
  constexpr int kTileElems = kTile * L::ld;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int len = a.len;
  const int q_tile = query_tile_of_block();
  const int q0 = q_tile * kTile;
  const int64_t bh = blockIdx.x;
  const HeadOperands<T> h(a, bh);

  const int tiles = (len + kTile - 1) / kTile;
  const int kv_tiles = a.causal ? min(q_tile + 1, tiles) : tiles;
  load_tile_async<T, D>(sQ, h.q, a.q_layout.row, q0, len);
  load_tile_async<T, D>(sK, h.k, a.k_layout.row, 0, len);
  load_tile_async<T, D>(sV, h.v, a.v_layout.row, 0, len);
  async_commit();

  uint32_t qf[D / 16][4];
  float o[D / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows g and g + 8, this thread's share of l
  const float factor = scale_log2 > 0.0f ? scale_log2 : 1.0f;  // what is left to scale the scores by
  const int row_lo = q0 + warp * 16 + g;
  for (int j = 0; j < kv_tiles; ++j) {
    next_key_value_tile<T, D>(sK, sV, h, a, j, kv_tiles);
    if (j == 0)
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) load_a(qf[kk], sQ, L::ld, warp * 16, kk * 16, lane);
    const T* tK = sK + (j & 1) * kTileElems;
    const T* tV = sV + (j & 1) * kTileElems;

    // S = Q K^T for this warp's 16 rows: 8 n-tiles of 8 keys.
    float s[kTile / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) product_abt_step<T, kTile / 8>(s, qf[kk], tK, L::ld, kk * 16, lane);

    // Online softmax in base 2, over this warp's rows and the tile's keys.
    // A positive scale goes into the exponent's FFMA (the maximum of scaled
    // scores is then the scaled maximum); any other scales them first.
    if (!(scale_log2 > 0.0f))
#pragma unroll
      for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] *= scale_log2;
    const int key_lo = j * kTile + 2 * t;
    if (a.causal && j == kv_tiles - 1)
      for_each_element<kTile / 8>(row_lo, key_lo, [&](int n, int e, int row, int key) {
        if (key > row) s[n][e] = -INFINITY;
      });
    if ((j + 1) * kTile > len)
      for_each_element<kTile / 8>(row_lo, key_lo, [&](int n, int e, int, int key) {
        if (key >= len) s[n][e] = -INFINITY;
      });
    float tile_max[2] = {row_half_max(s, 0) * factor, row_half_max(s, 1) * factor};
    float base[2], alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
      const float m_new = fmaxf(m[h], tile_max[h]);
      base[h] = m_new == -INFINITY ? 0.0f : m_new;  // a fully masked row stays all zero
      alpha[h] = exp2_flush(m[h] - base[h]);
      m[h] = m_new;
      l[h] *= alpha[h];
    }
#pragma unroll
    for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = exp2_flush(fmaf(s[n][e], factor, -base[e >> 1]));
    l[0] += row_half_sum(s, 0);
    l[1] += row_half_sum(s, 1);
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      o[n][0] *= alpha[0], o[n][1] *= alpha[0];
      o[n][2] *= alpha[1], o[n][3] *= alpha[1];
    }
    product_pb<T, D>(o, s, tV, L::ld, lane);
    __syncthreads();  // everyone is done with this buffer before it is refilled
  }

  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    inv[h] = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
  }
  T* out = const_cast<T*>(head_of<T>(a.out, a.out_layout, bh, a.heads));
  store_rows<T, D>(out, a.out_layout.row, q0 + warp * 16, len, o, inv[0], inv[1], lane);
  if (t == 0)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row_lo + h * 8;
      if (row < len) a.lse[bh * len + row] = (m[h] + log2f(l[h])) * kLn2;
    }
}

// The two backward kernels recompute P (and dS) from the saved log-sum-exp
// for each element: s the raw score and dp the raw dO·V product in, p and
// dS out; lse2 is the row's log-sum-exp in base 2. Elements outside the
// causal triangle or the sequence are then set to zero by `mask`.
__device__ __forceinline__ void probability_and_score_grad(float& s, float& dp, float lse2, float delta,
                                                           float scale, float scale_log2) {
  const float p = exp2_flush(s * scale_log2 - lse2);
  s = p;
  dp = p * (dp - delta) * scale;
}
__device__ __forceinline__ void mask(float& p, float& ds) { p = ds = 0.0f; }

// Blocks an SM for the backward kernels where the head size allows more
// than their registers would give by themselves (two 4-warp blocks each):
// a few bytes of spills are cheaper than the latency two blocks leave bare.
template <int D>
constexpr int kKeyGradBlocksPerSm = D <= 64 ? 3 : 1;
template <int D>
constexpr int kQueryGradBlocksPerSm = D <= 64 ? 4 : 1;

template <typename T, int D>
struct KeyGradLayout {
  static constexpr int ld = D + kPad;
  static constexpr size_t tile = size_t(kTile) * ld * sizeof(T);
  static constexpr size_t k = 0;
  static constexpr size_t v = k + tile;
  static constexpr size_t q = v + tile;         // two buffers
  static constexpr size_t dout = q + 2 * tile;  // two buffers
  static constexpr size_t lse = dout + 2 * tile;                     // two buffers
  static constexpr size_t delta = lse + 2 * kTile * sizeof(float);  // two buffers
  static constexpr size_t bytes = delta + 2 * kTile * sizeof(float);
};

// dK and dV: a block takes 64 keys; its warps own 16 each and keep their dK
// and dV accumulators in registers while query tiles stream past. Per tile a
// warp rebuilds P^T, forms dS^T, and adds dV += P^T dO and dK += dS^T Q,
// both straight from the score accumulators.
template <typename T, int D>
__global__ void __launch_bounds__(kBlockThreads, kKeyGradBlocksPerSm<D>)
    attention_key_grad_kernel(AttentionArgs a, AttentionGrads gr, float scale) {
  using L = KeyGradLayout<T, D>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem + L::k);
  T* sV = reinterpret_cast<T*>(smem + L::v);
  T* sQ = reinterpret_cast<T*>(smem + L::q);
  T* sdO = reinterpret_cast<T*>(smem + L::dout);
  float* sLse = reinterpret_cast<float*>(smem + L::lse);
  float* sDelta = reinterpret_cast<float*>(smem + L::delta);
  constexpr int kTileElems = kTile * L::ld;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int len = a.len;
  const int k_tile = key_tile_of_block();
  const int k0 = k_tile * kTile;
  const int64_t bh = blockIdx.x;
  const HeadOperands<T> h(a, bh);
  const T* dout = head_of<T>(gr.grad_out, gr.grad_out_layout, bh, a.heads);
  const float* lse = a.lse + bh * len;
  const float* delta = gr.delta + bh * len;

  const float scale_log2 = scale * kLog2e;
  const int tiles = (len + kTile - 1) / kTile;
  const int first = a.causal ? k_tile : 0;
  // Starts loading query tile i (Q, dO, log-sum-exp, delta) into buffer i
  // & 1, all asynchronously: a plain load here would hold the block at the
  // next barrier for a round trip to memory each tile. Rows past the end
  // read zeros and are masked below.
  auto prefetch = [&](int i) {
    const int buf = i & 1, row0 = i * kTile;
    load_tile_async<T, D>(sQ + buf * kTileElems, h.q, a.q_layout.row, row0, len);
    load_tile_async<T, D>(sdO + buf * kTileElems, dout, gr.grad_out_layout.row, row0, len);
    load_row_values_async(sLse + buf * kTile, lse, row0, len);
    load_row_values_async(sDelta + buf * kTile, delta, row0, len);
    async_commit();
  };
  load_tile_async<T, D>(sK, h.k, a.k_layout.row, k0, len);
  load_tile_async<T, D>(sV, h.v, a.v_layout.row, k0, len);
  prefetch(first);  // commits K and V with the first query tile

  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  const int key_lo = k0 + warp * 16 + g;  // this thread's keys: key_lo and key_lo + 8
  for (int i = first; i < tiles; ++i) {
    if (i + 1 < tiles) {
      prefetch(i + 1);
      async_wait<1>();
    } else {
      async_wait<0>();
    }
    __syncthreads();
    const int buf = i & 1, q0 = i * kTile;
    const T* tQ = sQ + buf * kTileElems;
    const T* tdO = sdO + buf * kTileElems;
    const float* tLse = sLse + buf * kTile;
    const float* tDelta = sDelta + buf * kTile;

    // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys x 64 queries.
    float s[kTile / 8][4] = {}, dp[kTile / 8][4] = {};
    product_abt<T, D, kTile / 8>(s, sK, warp * 16, tQ, L::ld, lane);
    product_abt<T, D, kTile / 8>(dp, sV, warp * 16, tdO, L::ld, lane);

    // P^T and dS^T: rows are this warp's keys, columns the tile's queries.
    for_each_element<kTile / 8>(key_lo, q0 + 2 * t, [&](int n, int e, int, int query) {
      const int col = query - q0;
      probability_and_score_grad(s[n][e], dp[n][e], tLse[col] * kLog2e, tDelta[col], scale, scale_log2);
    });
    if (a.causal && i == first)
      for_each_element<kTile / 8>(key_lo, q0 + 2 * t, [&](int n, int e, int key, int query) {
        if (key > query) mask(s[n][e], dp[n][e]);
      });
    if ((i + 1) * kTile > len || k0 + kTile > len)
      for_each_element<kTile / 8>(key_lo, q0 + 2 * t, [&](int n, int e, int key, int query) {
        if (key >= len || query >= len) mask(s[n][e], dp[n][e]);
      });
    // dV += P^T dO, dK += dS^T Q.
    product_pb<T, D>(dv, s, tdO, L::ld, lane);
    product_pb<T, D>(dk, dp, tQ, L::ld, lane);
    __syncthreads();  // this tile's buffers are free again
  }

  T* grad_k = const_cast<T*>(head_of<T>(gr.grad_k, gr.grad_k_layout, bh, a.heads));
  T* grad_v = const_cast<T*>(head_of<T>(gr.grad_v, gr.grad_v_layout, bh, a.heads));
  store_rows<T, D>(grad_k, gr.grad_k_layout.row, k0 + warp * 16, len, dk, 1.0f, 1.0f, lane);
  store_rows<T, D>(grad_v, gr.grad_v_layout.row, k0 + warp * 16, len, dv, 1.0f, 1.0f, lane);
}

// delta of one row, rowsum(dO * O), split over the four lanes of a quad
// (lane t of the quad takes columns [t D / 4, (t + 1) D / 4), in 16-byte
// packs; rows are 16-byte aligned) and added across the quad: every lane
// of the warp must call it.
template <typename T, int D>
__device__ __forceinline__ float row_delta(const T* dout_row, const T* out_row, int t) {
  constexpr int kPacks = D / 4 / 8;
  float acc = 0.0f;
#pragma unroll
  for (int p = 0; p < kPacks; ++p) {
    const Pack<T, 8> x = reinterpret_cast<const Pack<T, 8>*>(dout_row)[t * kPacks + p];
    const Pack<T, 8> y = reinterpret_cast<const Pack<T, 8>*>(out_row)[t * kPacks + p];
#pragma unroll
    for (int j = 0; j < 8; ++j) acc += Element<T>::load(x.v[j]) * Element<T>::load(y.v[j]);
  }
  acc += __shfl_xor_sync(0xffffffffu, acc, 1);
  return acc + __shfl_xor_sync(0xffffffffu, acc, 2);
}

template <typename T, int D>
struct QueryGradLayout {
  static constexpr int ld = D + kPad;
  static constexpr size_t tile = size_t(kTile) * ld * sizeof(T);
  static constexpr size_t q = 0;
  static constexpr size_t dout = q + tile;
  static constexpr size_t k = dout + tile;   // two buffers
  static constexpr size_t v = k + 2 * tile;  // two buffers
  static constexpr size_t bytes = v + 2 * tile;
};

// dQ: a block takes 64 queries, its warps 16 each, as the forward pass does,
// and key/value tiles stream past. Per tile a warp rebuilds P and dS for its
// rows and adds dQ += dS K, dS handed from the accumulators to the product's
// operand registers. dQ is summed in registers and written once, in the
// input type: no atomics, no f32 buffer to clear and cast, and the same
// bits on every run. This recomputes S and dP, which the key kernel also
// forms: two products more per tile pair, against dS^T through shared
// memory, f32 atomics, and a clear and a cast of the f32 buffer, which
// cost more.
template <typename T, int D>
__global__ void __launch_bounds__(kBlockThreads, kQueryGradBlocksPerSm<D>)
    attention_query_grad_kernel(AttentionArgs a, AttentionGrads gr, float scale) {
  using L = QueryGradLayout<T, D>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem + L::q);
  T* sdO = reinterpret_cast<T*>(smem + L::dout);
  T* sK = reinterpret_cast<T*>(smem + L::k);
  T* sV = reinterpret_cast<T*>(smem + L::v);
  constexpr int kTileElems = kTile * L::ld;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int len = a.len;
  const int q_tile = query_tile_of_block();
  const int q0 = q_tile * kTile;
  const int64_t bh = blockIdx.x;
  const HeadOperands<T> h(a, bh);
  const T* dout = head_of<T>(gr.grad_out, gr.grad_out_layout, bh, a.heads);

  const float scale_log2 = scale * kLog2e;
  const int tiles = (len + kTile - 1) / kTile;
  const int kv_tiles = a.causal ? min(q_tile + 1, tiles) : tiles;
  load_tile_async<T, D>(sQ, h.q, a.q_layout.row, q0, len);
  load_tile_async<T, D>(sdO, dout, gr.grad_out_layout.row, q0, len);
  load_tile_async<T, D>(sK, h.k, a.k_layout.row, 0, len);
  load_tile_async<T, D>(sV, h.v, a.v_layout.row, 0, len);
  async_commit();

  // This thread's rows, row_lo and row_lo + 8: their log-sum-exp (base 2)
  // and delta, which the key kernel (launched after) reads too; rows past
  // the end get P = 0 (a row within the sequence stands in for them in
  // row_delta, which the whole warp runs).
  const int row_lo = q0 + warp * 16 + g;
  const T* out = head_of<T>(a.out, a.out_layout, bh, a.heads);
  float lse2[2], delta[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row_lo + h * 8, r = min(row, len - 1);
    const float d = row_delta<T, D>(dout + r * gr.grad_out_layout.row, out + r * a.out_layout.row, t);
    lse2[h] = row < len ? a.lse[bh * len + row] * kLog2e : INFINITY;
    delta[h] = row < len ? d : 0.0f;
    if (t == 0 && row < len) gr.delta[bh * len + row] = d;
  }
  float dq[D / 8][4] = {};
  for (int j = 0; j < kv_tiles; ++j) {
    next_key_value_tile<T, D>(sK, sV, h, a, j, kv_tiles);
    const T* tK = sK + (j & 1) * kTileElems;
    const T* tV = sV + (j & 1) * kTileElems;

    // S = Q K^T and dP = dO V^T for this warp's 16 queries x 64 keys.
    float s[kTile / 8][4] = {}, dp[kTile / 8][4] = {};
    product_abt<T, D, kTile / 8>(s, sQ, warp * 16, tK, L::ld, lane);
    product_abt<T, D, kTile / 8>(dp, sdO, warp * 16, tV, L::ld, lane);

    // P and dS: rows are this warp's queries, columns the tile's keys.
    const int key_lo = j * kTile + 2 * t;
    for_each_element<kTile / 8>(row_lo, key_lo, [&](int n, int e, int, int) {
      probability_and_score_grad(s[n][e], dp[n][e], lse2[e >> 1], delta[e >> 1], scale, scale_log2);
    });
    if (a.causal && j == kv_tiles - 1)
      for_each_element<kTile / 8>(row_lo, key_lo, [&](int n, int e, int row, int key) {
        if (key > row) mask(s[n][e], dp[n][e]);
      });
    if ((j + 1) * kTile > len)
      for_each_element<kTile / 8>(row_lo, key_lo, [&](int n, int e, int, int key) {
        if (key >= len) mask(s[n][e], dp[n][e]);
      });
    product_pb<T, D>(dq, dp, tK, L::ld, lane);
    __syncthreads();  // everyone is done with this buffer before it is refilled
  }

  T* grad_q = const_cast<T*>(head_of<T>(gr.grad_q, gr.grad_q_layout, bh, a.heads));
  store_rows<T, D>(grad_q, gr.grad_q_layout.row, q0 + warp * 16, len, dq, 1.0f, 1.0f, lane);
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

static_assert(kAttentionMaxLength == int64_t{65535} * kTile, "the length limit assumes tiles of kTile rows on grid y");

dim3 grid_of(const AttentionArgs& a) {
  return dim3(static_cast<unsigned>(a.batch * a.heads), static_cast<unsigned>((a.len + kTile - 1) / kTile));
}

template <typename T, int D>
void forward_typed(const Launch& l, const AttentionArgs& a) {
  using L = ForwardLayout<T, D>;
  auto kernel = attention_forward_kernel<T, D>;
  static std::atomic<uint64_t> devices_set{0};
  allow_shared_memory(kernel, L::bytes, l.device, devices_set);
  kernel<<<grid_of(a), kBlockThreads, L::bytes, l.stream>>>(a, static_cast<float>(a.scale) * kLog2e);
  MPT_CUDA_CHECK_LAUNCH("attention_forward_kernel");
}

template <typename T, int D>
void backward_typed(const Launch& l, const AttentionArgs& a, const AttentionGrads& g) {
  const float scale = static_cast<float>(a.scale);
  // The query kernel first: it writes each row's delta, which the key
  // kernel reads.
  auto query_kernel = attention_query_grad_kernel<T, D>;
  static std::atomic<uint64_t> query_devices_set{0};
  allow_shared_memory(query_kernel, QueryGradLayout<T, D>::bytes, l.device, query_devices_set);
  query_kernel<<<grid_of(a), kBlockThreads, QueryGradLayout<T, D>::bytes, l.stream>>>(a, g, scale);
  MPT_CUDA_CHECK_LAUNCH("attention_query_grad_kernel");
  auto key_kernel = attention_key_grad_kernel<T, D>;
  static std::atomic<uint64_t> key_devices_set{0};
  allow_shared_memory(key_kernel, KeyGradLayout<T, D>::bytes, l.device, key_devices_set);
  key_kernel<<<grid_of(a), kBlockThreads, KeyGradLayout<T, D>::bytes, l.stream>>>(a, g, scale);
  MPT_CUDA_CHECK_LAUNCH("attention_key_grad_kernel");
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
  if (a.len == 0 || a.batch * a.heads == 0) return;
  dispatch(a.dtype, a.head_dim, [&]<typename T, int D>() { forward_typed<T, D>(l, a); });
}

void launch_attention_backward(const Launch& l, const AttentionArgs& a, const AttentionGrads& g) {
  if (a.len == 0 || a.batch * a.heads == 0) return;
  dispatch(a.dtype, a.head_dim, [&]<typename T, int D>() { backward_typed<T, D>(l, a, g); });
}

}  // namespace mpt::cuda
