// Fused layer norm over the last dimension: one warp per row, the row held
// in registers, statistics in f32. Each lane owns chunks of V adjacent
// columns, chunks lane, lane + 32, ...: V = 4 (one 16- or 8-byte access a
// chunk) where the width and the pointers allow, else 1. Forward writes y
// and each row's mean and 1/std; backward writes dx (plus a gradient that
// reached x by another path, when given: a pre-norm block's residual) and
// one row of column sums per block for dweight and dbias, which a second
// small kernel adds up (no atomics: the same sums every run).
// y and dy may be 16-bit where x is f32: autocast runs the norm in f32 and
// a matmul after it would cast the result at once, so the norm rounds its
// f32 result on the store instead (the same value the cast would make).
#include "tensor/cuda/kernel_utils.cuh"
#include "tensor/cuda/layer_norm.h"

namespace mpt::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;

// The V elements at p (aligned to V elements) as floats, and back.
template <typename T, int V>
__device__ __forceinline__ void load_chunk(float* out, const T* p) {
  const Pack<T, V> pack = *reinterpret_cast<const Pack<T, V>*>(p);
#pragma unroll
  for (int j = 0; j < V; ++j) out[j] = Element<T>::load(pack.v[j]);
}
template <typename T, int V>
__device__ __forceinline__ void store_chunk(T* p, const float* in) {
  Pack<T, V> pack;
#pragma unroll
  for (int j = 0; j < V; ++j) pack.v[j] = Element<T>::store(in[j]);
  *reinterpret_cast<Pack<T, V>*>(p) = pack;
}
// The first column of a lane's chunk i.
template <int V>
__device__ __forceinline__ int chunk_column(int lane, int i) {
  return (lane + 32 * i) * V;
}

template <typename T, typename TY, int kCols, int V>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    layer_norm_forward_kernel(TY* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                              const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                              int64_t rows, int d, float eps) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; row < rows;
       row += warps) {
    const T* xr = x + row * d;
    // The weight and bias load with the row, so the row waits for memory
    // once, not again after its statistics.
    float v[kCols] = {}, wv[kCols] = {}, bv[kCols] = {};
#pragma unroll
    for (int i = 0; i < kCols / V; ++i) {
      const int c = chunk_column<V>(lane, i);
      if (c >= d) continue;
      load_chunk<T, V>(v + i * V, xr + c);
      if (w) load_chunk<T, V>(wv + i * V, w + c);
      if (b) load_chunk<T, V>(bv + i * V, b + c);
    }
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kCols; ++k) sum += v[k];
    const float mean = warp_sum(sum) / d;
    float sq = 0.0f;
#pragma unroll
    for (int k = 0; k < kCols; ++k) {
      const float dev = chunk_column<V>(lane, k / V) < d ? v[k] - mean : 0.0f;
      sq += dev * dev;
    }
    const float rstd = 1.0f / sqrtf(warp_sum(sq) / d + eps);
    TY* yr = y + row * d;
#pragma unroll
    for (int i = 0; i < kCols / V; ++i) {
      const int c = chunk_column<V>(lane, i);
      if (c >= d) continue;
      float out[V];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        out[j] = (v[i * V + j] - mean) * rstd;
        if (w) out[j] *= wv[i * V + j];
        if (b) out[j] += bv[i * V + j];
      }
      store_chunk<TY, V>(yr + c, out);
    }
    if (lane == 0) {
      mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
  }
}

// partial_w/partial_b: [blocks, d] f32, this block's sums over its rows.
// dx_more: null, or a gradient of x (x's dtype) to add into dx.
// Rows of up to 384 fit three backward blocks an SM in registers, with a
// few bytes of spills; wider ones keep what their registers give.
template <int kCols>
constexpr int kBackwardBlocksPerSm = kCols <= 12 ? 3 : 1;

template <typename T, typename TY, int kCols, int V>
__global__ void __launch_bounds__(kWarpsPerBlock * 32, kBackwardBlocksPerSm<kCols>)
    layer_norm_backward_kernel(T* __restrict__ dx, TY* __restrict__ dx_narrow, float* __restrict__ partial_w,
                               float* __restrict__ partial_b, const TY* __restrict__ dy,
                               const T* __restrict__ dx_more, const T* __restrict__ x,
                               const T* __restrict__ w, const float* __restrict__ mean_in,
                               const float* __restrict__ rstd_in, int64_t rows, int d) {
  __shared__ float block_sums[kWarpsPerBlock][kCols * 32];
  const int lane = threadIdx.x % 32;
  const int64_t warp_id = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  float acc_w[kCols], acc_b[kCols];
#pragma unroll
  for (int i = 0; i < kCols; ++i) acc_w[i] = acc_b[i] = 0.0f;
  // What a row reads (dy, x, and dx_more where given). Rows of 385 to 768
  // load it a row ahead: the warp's next row is in flight while it works on
  // this one. Loaded only when the row came to be worked on, GPT-2 small's
  // backward (rows of 768, one block an SM by its registers) waited on
  // memory at every row and ran at two thirds of the memory's speed.
  // Narrower rows would spill at three blocks an SM, wider ones at one, so
  // they load each chunk as they come to it.
  constexpr bool kAhead = kCols > 12 && kCols <= 24;
  // Column c's chunk of the row: dy into gy, x into xv, dx_more into more.
  auto load_row_chunk = [&](int64_t row, int c, float* gy, float* xv, float* more) {
    load_chunk<TY, V>(gy, dy + row * d + c);
    load_chunk<T, V>(xv, x + row * d + c);
    if (dx_more) load_chunk<T, V>(more, dx_more + row * d + c);
  };
  auto load_row = [&](int64_t row, float(&gy)[kCols], float(&xv)[kCols], float(&more)[kCols]) {
#pragma unroll
    for (int i = 0; i < kCols / V; ++i) {
      const int c = chunk_column<V>(lane, i);
      if (c < d) load_row_chunk(row, c, gy + i * V, xv + i * V, more + i * V);
    }
  };
  // The row ahead's values (kAhead), and the row's gradient from dx_more.
  float gy_ahead[kAhead ? kCols : 1] = {}, xv_ahead[kAhead ? kCols : 1] = {}, more[kCols] = {};
  if constexpr (kAhead) {
    if (warp_id < rows) load_row(warp_id, gy_ahead, xv_ahead, more);
  }
  for (int64_t row = warp_id; row < rows; row += warps) {
    const float mean = mean_in[row], rstd = rstd_in[row];
    float gy_next[kAhead ? kCols : 1] = {}, xv_next[kAhead ? kCols : 1] = {}, more_next[kAhead ? kCols : 1] = {};
    if constexpr (kAhead) {
      if (row + warps < rows) load_row(row + warps, gy_next, xv_next, more_next);
    }
    float xhat[kCols] = {}, g[kCols] = {};
#pragma unroll
    for (int i = 0; i < kCols / V; ++i) {
      const int c = chunk_column<V>(lane, i);
      if (c >= d) continue;
      float gy[V], xv[V], wv[V];
      if constexpr (kAhead) {
#pragma unroll
        for (int j = 0; j < V; ++j) gy[j] = gy_ahead[i * V + j], xv[j] = xv_ahead[i * V + j];
      } else {
        load_row_chunk(row, c, gy, xv, more + i * V);
      }
      if (w) load_chunk<T, V>(wv, w + c);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int k = i * V + j;
        xhat[k] = (xv[j] - mean) * rstd;
        g[k] = w ? gy[j] * wv[j] : gy[j];
        acc_w[k] += gy[j] * xhat[k];
        acc_b[k] += gy[j];
      }
    }
    float sum_g = 0.0f, sum_gx = 0.0f;
#pragma unroll
    for (int k = 0; k < kCols; ++k) {
      sum_g += g[k];
      sum_gx += g[k] * xhat[k];
    }
    const float mean_g = warp_sum(sum_g) / d, mean_gx = warp_sum(sum_gx) / d;
#pragma unroll
    for (int i = 0; i < kCols / V; ++i) {
      const int c = chunk_column<V>(lane, i);
      if (c >= d) continue;
      float grad[V];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int k = i * V + j;
        grad[j] = rstd * (g[k] - mean_g - xhat[k] * mean_gx);
        // A separate rounded add (no FMA with the product above): the sum
        // the engine would make of the two gradients, bit for bit.
        if (dx_more) grad[j] = __fadd_rn(grad[j], more[k]);
      }
      store_chunk<T, V>(dx + row * d + c, grad);
      // The 16-bit copy the branch's linear layer reads (Storage::NarrowCopy).
      if (dx_narrow) store_chunk<TY, V>(dx_narrow + row * d + c, grad);
    }
    if constexpr (kAhead) {
#pragma unroll
      for (int k = 0; k < kCols; ++k) gy_ahead[k] = gy_next[k], xv_ahead[k] = xv_next[k], more[k] = more_next[k];
    }
  }
  // The warps' column sums added in shared memory: one row per block, so
  // the second pass reads a few hundred rows instead of thousands.
  auto block_row = [&](const float (&acc)[kCols], float* partial) {
#pragma unroll
    for (int k = 0; k < kCols; ++k) block_sums[threadIdx.x / 32][chunk_column<V>(lane, k / V) + k % V] = acc[k];
    __syncthreads();
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
      float sum = 0.0f;
#pragma unroll
      for (int k = 0; k < kWarpsPerBlock; ++k) sum += block_sums[k][c];
      partial[static_cast<int64_t>(blockIdx.x) * d + c] = sum;
    }
    __syncthreads();
  };
  block_row(acc_w, partial_w);
  block_row(acc_b, partial_b);
}

// dweight and dbias from the blocks' rows of partial sums, in one launch:
// blockIdx.y picks which; a block adds 32 columns, its rows of threads
// splitting the partial rows, then one row of threads adds those up.
constexpr int kParamRowsPerBlock = 16;
__global__ void __launch_bounds__(32 * kParamRowsPerBlock)
    layer_norm_param_grads_kernel(const float* __restrict__ partial_w, const float* __restrict__ partial_b,
                                  float* __restrict__ grad_w, float* __restrict__ grad_b, int64_t partials, int d) {
  __shared__ float sums[kParamRowsPerBlock][32];
  const float* partial = blockIdx.y == 0 ? partial_w : partial_b;
  float* out = blockIdx.y == 0 ? grad_w : grad_b;
  if (!out) return;
  const int c = blockIdx.x * 32 + threadIdx.x;
  float sum = 0.0f;
  if (c < d)
#pragma unroll 4
    for (int64_t r = threadIdx.y; r < partials; r += kParamRowsPerBlock) sum += partial[r * d + c];
  sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || c >= d) return;
#pragma unroll
  for (int k = 1; k < kParamRowsPerBlock; ++k) sum += sums[k][threadIdx.x];
  out[c] = sum;
}

// Whether a's rows (and those of `more` operands) can move in chunks of
// four: the width a multiple of 4 and every pointer 16-byte aligned.
bool chunks_of_four(const LayerNormArgs& a, std::initializer_list<const void*> more = {}) {
  return a.d % 4 == 0 && aligned_to(16, {a.x, a.weight, a.bias}) && aligned_to(16, more);
}

// Calls f.template operator()<T, TY, kCols, V>() for x's dtype T, y's (and
// dy's) dtype TY, the registers a row needs (32 kCols columns; the widths
// of common models, 384 and 768, get theirs exactly: a register array a
// third too long costs the backward pass a block an SM) and the chunk size.
template <typename F>
void dispatch(DType dtype, DType y_dtype, int d, bool four, const char* op, F&& f) {
  auto by_cols = [&]<typename T, typename TY>() {
    auto by_chunk = [&]<int kCols>() {
      return four ? f.template operator()<T, TY, kCols, 4>() : f.template operator()<T, TY, kCols, 1>();
    };
    if (d <= 128) return by_chunk.template operator()<4>();
    if (d <= 256) return by_chunk.template operator()<8>();
    if (d <= 384) return by_chunk.template operator()<12>();
    if (d <= 512) return by_chunk.template operator()<16>();
    if (d <= 768) return by_chunk.template operator()<24>();
    return by_chunk.template operator()<32>();
  };
  if (y_dtype == dtype)
    return dispatch_floating<false>(dtype, op, [&](auto tag) {
      using T = decltype(tag);
      by_cols.template operator()<T, T>();
    });
  if (dtype == DType::f32 && y_dtype == DType::f16) return by_cols.template operator()<float, __half>();
  if (dtype == DType::f32 && y_dtype == DType::bf16) return by_cols.template operator()<float, __nv_bfloat16>();
  throw_dtype_unsupported(op, y_dtype);
}

// Blocks for `rows` rows, at most `per_sm` a multiprocessor (the rest loop).
unsigned blocks_for(const Launch& l, int64_t rows, int per_sm) {
  const int64_t want = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(want, int64_t{per_sm} * l.sm_count)));
}

// The backward kernel runs one wave: as many blocks as fit on the GPU at
// once (its row sums stay in registers, so few do: 3 an SM for rows of
// 384, by its launch bounds), each looping over rows. Every block adds a
// row of partial sums, and a second, partial wave costs more than it hides
// (measured: docs/PERFORMANCE.md, "Decisions and their measurements").
template <typename T, typename TY, int kCols, int V>
unsigned backward_blocks(const Launch& l, int64_t rows) {
  static const int resident = [] {
    int n = 0;
    MPT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, layer_norm_backward_kernel<T, TY, kCols, V>,
                                                                 kWarpsPerBlock * 32, 0));
    return std::max(n, 1);
  }();
  return blocks_for(l, rows, resident);
}

}  // namespace

bool fused_layer_norm_supported(DType dtype, DType y_dtype, int64_t d) {
  const bool dtypes = (dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16) &&
                      (y_dtype == dtype || (dtype == DType::f32 && (y_dtype == DType::f16 || y_dtype == DType::bf16)));
  return dtypes && d >= 1 && d <= kMaxFusedLayerNorm;
}

void launch_layer_norm_forward(const Launch& l, const LayerNormArgs& a, void* y) {
  if (a.rows == 0) return;
  // A block for every 8 rows (up to 16 an SM): its few registers let 6
  // blocks an SM run at once, and rows in flight hide the loads' latency.
  const bool four = chunks_of_four(a, {y});
  dispatch(a.dtype, a.y_dtype, a.d, four, "layer_norm", [&]<typename T, typename TY, int kCols, int V>() {
    layer_norm_forward_kernel<T, TY, kCols, V><<<blocks_for(l, a.rows, 16), kWarpsPerBlock * 32, 0, l.stream>>>(
        static_cast<TY*>(y), a.mean, a.rstd, static_cast<const T*>(a.x), static_cast<const T*>(a.weight),
        static_cast<const T*>(a.bias), a.rows, a.d, a.eps);
  });
  MPT_CUDA_CHECK_LAUNCH("layer_norm_forward_kernel");
}

int64_t layer_norm_backward_partials(const Launch& l, const LayerNormArgs& a) {
  int64_t blocks = 0;
  dispatch(a.dtype, a.y_dtype, a.d, chunks_of_four(a), "layer_norm backward",
           [&]<typename T, typename TY, int kCols, int V>() { blocks = backward_blocks<T, TY, kCols, V>(l, a.rows); });
  return blocks;
}

void launch_layer_norm_backward(const Launch& l, const LayerNormArgs& a, const void* dy, const void* dx_more,
                                void* dx, void* dx_narrow, float* partial_w, float* partial_b) {
  if (a.rows == 0) return;
  // As many blocks as there are rows of partial sums, whichever chunk size
  // the operands allow: every block writes one.
  const auto blocks = static_cast<unsigned>(layer_norm_backward_partials(l, a));
  const bool four = chunks_of_four(a, {dy, dx_more, dx, dx_narrow});
  dispatch(a.dtype, a.y_dtype, a.d, four, "layer_norm backward", [&]<typename T, typename TY, int kCols, int V>() {
    layer_norm_backward_kernel<T, TY, kCols, V><<<blocks, kWarpsPerBlock * 32, 0, l.stream>>>(
        static_cast<T*>(dx), static_cast<TY*>(dx_narrow), partial_w, partial_b, static_cast<const TY*>(dy),
        static_cast<const T*>(dx_more), static_cast<const T*>(a.x), static_cast<const T*>(a.weight), a.mean,
        a.rstd, a.rows, a.d);
  });
  MPT_CUDA_CHECK_LAUNCH("layer_norm_backward_kernel");
}

void launch_layer_norm_param_grads(const Launch& l, const LayerNormArgs& a, const float* partial_w,
                                   const float* partial_b, float* grad_w, float* grad_b) {
  if (!grad_w && !grad_b) return;
  const dim3 grid(static_cast<unsigned>((a.d + 31) / 32), 2), block(32, kParamRowsPerBlock);
  layer_norm_param_grads_kernel<<<grid, block, 0, l.stream>>>(partial_w, partial_b, grad_w, grad_b,
                                                              layer_norm_backward_partials(l, a), a.d);
  MPT_CUDA_CHECK_LAUNCH("layer_norm_param_grads_kernel");
}

}  // namespace mpt::cuda
