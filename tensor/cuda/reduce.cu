// Reductions of a contiguous [outer, k, inner] tensor over k.
//
// inner == 1 (rows): a warp per row for short rows, a block per row for long
//   ones, combining with warp shuffles.
// inner > 1 (columns): threads side by side along inner, so each step over k
//   reads consecutive addresses, and several threads per column share k.
// When that leaves too few blocks to fill the GPU (a handful of long rows,
// say a full sum), k is also split across blocks: each writes a partial
// result to a workspace and a second kernel combines them.
//
// The combine step is associative and commutative, also for argmax (larger
// value wins, NaN beats everything, ties go to the lower index), so every
// split and tree order gives the same index as a left-to-right scan.
#include "tensor/cuda/caching_allocator.h"
#include "tensor/cuda/kernel_utils.cuh"

namespace mpt::cuda {
namespace {

template <typename A>
struct Acc {
  A v;
  int64_t i;  // argmax only
};

template <typename A>
__device__ __forceinline__ bool is_nan(A x) {
  return x != x;
}

template <typename A>
__device__ __forceinline__ A infinity() {
  return A(__builtin_huge_val());
}

template <typename A>
__device__ __forceinline__ Acc<A> identity(ReduceOp op) {
  switch (op) {
    case ReduceOp::max: return {-infinity<A>(), 0};
    case ReduceOp::min: return {infinity<A>(), 0};
    case ReduceOp::argmax: return {-infinity<A>(), INT64_MAX};
    default: return {A(0), 0};
  }
}

template <typename A>
__device__ __forceinline__ Acc<A> combine(ReduceOp op, const Acc<A>& a, const Acc<A>& b) {
  switch (op) {
    case ReduceOp::max:
      if (is_nan(a.v)) return a;
      return (is_nan(b.v) || b.v > a.v) ? b : a;
    case ReduceOp::min:
      if (is_nan(a.v)) return a;
      return (is_nan(b.v) || b.v < a.v) ? b : a;
    case ReduceOp::argmax: {
      const bool an = is_nan(a.v), bn = is_nan(b.v);
      if (an != bn) return an ? a : b;
      if (!an && a.v != b.v) return a.v > b.v ? a : b;
      return a.i <= b.i ? a : b;
    }
    default: return {a.v + b.v, 0};
  }
}

template <typename A>
__device__ __forceinline__ Acc<A> warp_reduce(ReduceOp op, Acc<A> acc) {
#pragma unroll
  for (int delta = 16; delta > 0; delta /= 2) {
    const Acc<A> other{__shfl_down_sync(0xffffffffu, acc.v, delta), __shfl_down_sync(0xffffffffu, acc.i, delta)};
    acc = combine(op, acc, other);
  }
  return acc;
}

template <typename T, typename A>
__device__ __forceinline__ void write_result(ReduceOp op, void* out, int64_t idx, const Acc<A>& acc, int64_t k) {
  if (op == ReduceOp::argmax) {
    static_cast<int64_t*>(out)[idx] = acc.i;
  } else {
    // Times the reciprocal, as the CPU does, so both round alike.
    const A v = op == ReduceOp::mean ? acc.v * (A(1) / static_cast<A>(k)) : acc.v;
    static_cast<T*>(out)[idx] = Element<T>::store(v);
  }
}

struct Split {
  int64_t chunk;  // k per split
  int splits;
};

// blockDim (32, R): a warp per row; or (L, 1): a block per row. Without
// splitting (splits == 1) the result goes to out, else to partial[row, split].
// `packed`: rows and split chunks start 16-byte aligned, so whole Packs load.
template <typename T>
__global__ void reduce_rows_kernel(ReduceOp op, const T* in, void* out, Acc<typename Element<T>::Compute>* partial,
                                   int64_t outer, int64_t k, Split split, bool packed) {
  constexpr int V = 16 / sizeof(T);
  using P = Pack<T, V>;
  using A = typename Element<T>::Compute;
  __shared__ Acc<A> warp_results[32];
  const int64_t k0 = blockIdx.y * split.chunk, k1 = min(k, k0 + split.chunk);
  // Loop bounds are uniform within a row group, so the barriers below are
  // reached by the whole block (blockDim.y == 1 whenever they are used).
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; row < outer;
       row += static_cast<int64_t>(gridDim.x) * blockDim.y) {
    const T* p = in + row * k;
    Acc<A> acc = identity<A>(op);
    if (packed) {
      for (int64_t j = k0 / V + threadIdx.x; j < k1 / V; j += blockDim.x) {
        const P x = reinterpret_cast<const P*>(p)[j];
#pragma unroll
        for (int e = 0; e < V; ++e) acc = combine(op, acc, Acc<A>{Element<T>::load(x.v[e]), j * V + e});
      }
    } else {
      for (int64_t j = k0 + threadIdx.x; j < k1; j += blockDim.x)
        acc = combine(op, acc, Acc<A>{Element<T>::load(p[j]), j});
    }
    acc = warp_reduce(op, acc);
    if (blockDim.x > 32) {
      const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
      if (lane == 0) warp_results[warp] = acc;
      __syncthreads();
      if (warp == 0) {
        acc = lane < static_cast<int>(blockDim.x / 32) ? warp_results[lane] : identity<A>(op);
        acc = warp_reduce(op, acc);
      }
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      if (split.splits == 1) write_result<T>(op, out, row, acc, k);
      else partial[row * split.splits + blockIdx.y] = acc;
    }
  }
}

// blockDim (X, Y), X * Y == kThreads: x along inner, y along k.
template <typename T>
__global__ void reduce_cols_kernel(ReduceOp op, const T* in, void* out, Acc<typename Element<T>::Compute>* partial,
                                   int64_t outer, int64_t k, int64_t inner, Split split) {
  using A = typename Element<T>::Compute;
  __shared__ Acc<A> tile[kThreads];
  const int64_t k0 = blockIdx.y * split.chunk, k1 = min(k, k0 + split.chunk);
  const int64_t tiles_per_row = (inner + blockDim.x - 1) / blockDim.x;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  for (int64_t t = blockIdx.x; t < outer * tiles_per_row; t += gridDim.x) {  // uniform across the block
    const int64_t o = t / tiles_per_row;
    const int64_t i = (t % tiles_per_row) * blockDim.x + threadIdx.x;
    Acc<A> acc = identity<A>(op);
    if (i < inner) {
      const T* p = in + o * k * inner + i;
#pragma unroll 4  // several loads in flight per thread
      for (int64_t j = k0 + threadIdx.y; j < k1; j += blockDim.y)
        acc = combine(op, acc, Acc<A>{Element<T>::load(p[j * inner]), j});
    }
    tile[tid] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && i < inner) {
      for (int r = 1; r < static_cast<int>(blockDim.y); ++r) acc = combine(op, acc, tile[r * blockDim.x + threadIdx.x]);
      if (split.splits == 1) write_result<T>(op, out, o * inner + i, acc, k);
      else partial[(o * split.splits + blockIdx.y) * inner + i] = acc;
    }
    __syncthreads();
  }
}

// Sums (and means) over k of wide columns (inner a multiple of a 16-byte
// pack): a warp reads 32 consecutive packs of one k-row (512 contiguous
// bytes), each thread keeping V column sums in f32; the block's Y rows of
// threads take turns along k and add up in shared memory. The bias
// gradients of linear layers are this case, and the general kernel above
// moves only 2 bytes per thread and load there. Partial sums per k-split go
// to partial[outer, splits, inner] as plain floats.
template <typename T>
__global__ void sum_cols_packed_kernel(bool mean, const T* in, T* out, float* partial, int64_t outer, int64_t k,
                                       int64_t inner, Split split) {
  constexpr int V = 16 / sizeof(T);
  using P = Pack<T, V>;
  __shared__ float tile[kThreads / 32][32 * V];
  const int64_t col_tiles = (inner + 32 * V - 1) / (32 * V);
  const int64_t o = blockIdx.x / col_tiles;
  const int64_t col = (blockIdx.x % col_tiles) * 32 * V + static_cast<int64_t>(threadIdx.x) * V;
  const int64_t k0 = blockIdx.y * split.chunk, k1 = min(k, k0 + split.chunk);
  float acc[V] = {};
  if (col < inner) {
    const T* p = in + o * k * inner + col;
#pragma unroll 4
    for (int64_t j = k0 + threadIdx.y; j < k1; j += blockDim.y) {
      const P x = *reinterpret_cast<const P*>(p + j * inner);
#pragma unroll
      for (int e = 0; e < V; ++e) acc[e] += Element<T>::load(x.v[e]);
    }
  }
#pragma unroll
  for (int e = 0; e < V; ++e) tile[threadIdx.y][threadIdx.x * V + e] = acc[e];
  __syncthreads();
  // The first row of threads adds the others' sums, one column each.
  if (threadIdx.y == 0 && col < inner) {
#pragma unroll
    for (int e = 0; e < V; ++e) {
      float v = tile[0][threadIdx.x * V + e];
      for (int r = 1; r < static_cast<int>(blockDim.y); ++r) v += tile[r][threadIdx.x * V + e];
      if (split.splits == 1) {
        out[o * inner + col + e] = Element<T>::store(mean ? v * (1.0f / static_cast<float>(k)) : v);
      } else {
        partial[(o * split.splits + blockIdx.y) * inner + col + e] = v;
      }
    }
  }
}

// partial [outer, splits, inner] -> out. Block (32, Y): x along inner, y
// along the splits, each thread adding every Y-th split, then the Y partial
// sums combined in a fixed order (deterministic). A thread per column alone
// would chain dozens of dependent loads, and a handful of blocks cannot
// hide that.
template <typename T>
__global__ void sum_cols_finalize_kernel(bool mean, const float* partial, T* out, int64_t outer, int64_t inner,
                                         int splits, int64_t k) {
  __shared__ float tile[kThreads / 32][32];
  const int64_t col_tiles = (inner + 31) / 32;
  const int64_t o = blockIdx.x / col_tiles;
  const int64_t i = (blockIdx.x % col_tiles) * 32 + threadIdx.x;
  float v = 0.0f;
  if (i < inner)
    for (int s = threadIdx.y; s < splits; s += blockDim.y) v += partial[(o * splits + s) * inner + i];
  tile[threadIdx.y][threadIdx.x] = v;
  __syncthreads();
  if (threadIdx.y == 0 && i < inner) {
    for (int r = 1; r < static_cast<int>(blockDim.y); ++r) v += tile[r][threadIdx.x];
    out[o * inner + i] = Element<T>::store(mean ? v * (1.0f / static_cast<float>(k)) : v);
  }
}

// partial [outer, splits, inner] -> out [outer, inner]. With splits == 0
// (k == 0) it writes the identity: sum 0, mean NaN, max -inf.
template <typename T>
__global__ void reduce_finalize_kernel(ReduceOp op, const Acc<typename Element<T>::Compute>* partial, void* out,
                                       int64_t outer, int64_t inner, int splits, int64_t k) {
  using A = typename Element<T>::Compute;
  for (int64_t idx = global_thread(); idx < outer * inner; idx += grid_threads()) {
    const int64_t o = idx / inner, i = idx % inner;
    Acc<A> acc = identity<A>(op);
    for (int s = 0; s < splits; ++s) acc = combine(op, acc, partial[(o * splits + s) * inner + i]);
    write_result<T>(op, out, idx, acc, k);
  }
}

// Splits k when `blocks` would not fill every SM (kThreads-thread blocks,
// 2048 threads per SM), keeping at least min_chunk elements of k per split
// and chunks a multiple of `align` elements.
Split choose_split(const Launch& l, int64_t blocks, int64_t k, int64_t min_chunk, int64_t align) {
  const int64_t target = static_cast<int64_t>(l.sm_count) * (2048 / kThreads);
  int64_t splits = 1;
  if (blocks < target) splits = std::min((target + blocks - 1) / blocks, (k + min_chunk - 1) / min_chunk);
  splits = std::clamp<int64_t>(splits, 1, 1024);
  int64_t chunk = (k + splits - 1) / splits;
  chunk = (chunk + align - 1) / align * align;
  return Split{chunk, static_cast<int>((k + chunk - 1) / chunk)};
}

// A stream-ordered scratch buffer: freed right after the launches that use
// it were queued, the block can only be reused by later work on this stream.
class Workspace {
 public:
  Workspace(const Launch& l, size_t nbytes) : device_(l.device), ptr_(caching_allocator(l.device).allocate(nbytes, l.stream)) {}
  ~Workspace() { caching_allocator(device_).free(ptr_); }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  void* get() const { return ptr_; }

 private:
  int device_;
  void* ptr_;
};

// Sums and means of 16-byte aligned columns in f32 or 16-bit floats (f64
// keeps the general kernel and its f64 accumulator).
template <typename T>
bool sum_cols_packed(const Launch& l, ReduceOp op, const T* in, void* out, int64_t outer, int64_t k, int64_t inner) {
  constexpr int V = 16 / sizeof(T);
  if ((op != ReduceOp::sum && op != ReduceOp::mean) || sizeof(T) > 4 || k == 0 || inner % V != 0 ||
      !aligned_to(16, {in}))
    return false;
  const bool mean = op == ReduceOp::mean;
  const dim3 block(32, kThreads / 32);
  const int64_t blocks = outer * ((inner + 32 * V - 1) / (32 * V));
  const Split split = choose_split(l, blocks, k, 4 * block.y, 1);
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(split.splits));
  if (blocks > INT32_MAX) return false;
  T* result = static_cast<T*>(out);
  if (split.splits == 1) {
    sum_cols_packed_kernel<T><<<grid, block, 0, l.stream>>>(mean, in, result, nullptr, outer, k, inner, split);
    MPT_CUDA_CHECK_LAUNCH("sum_cols_packed_kernel");
    return true;
  }
  Workspace ws(l, static_cast<size_t>(outer * split.splits * inner) * sizeof(float));
  auto* partial = static_cast<float*>(ws.get());
  sum_cols_packed_kernel<T><<<grid, block, 0, l.stream>>>(mean, in, result, partial, outer, k, inner, split);
  MPT_CUDA_CHECK_LAUNCH("sum_cols_packed_kernel");
  const unsigned finalize_blocks = static_cast<unsigned>(outer * ((inner + 31) / 32));
  sum_cols_finalize_kernel<T><<<finalize_blocks, block, 0, l.stream>>>(mean, partial, result, outer, inner,
                                                                        split.splits, k);
  MPT_CUDA_CHECK_LAUNCH("sum_cols_finalize_kernel");
  return true;
}

template <typename T>
void reduce_typed(const Launch& l, ReduceOp op, const void* in_ptr, void* out, int64_t outer, int64_t k,
                  int64_t inner) {
  using A = typename Element<T>::Compute;
  const T* in = static_cast<const T*>(in_ptr);
  if (outer * inner == 0) return;
  if (inner > 1 && sum_cols_packed<T>(l, op, in, out, outer, k, inner)) return;
  if (k == 0) {
    reduce_finalize_kernel<T><<<grid_for(l, outer * inner), kThreads, 0, l.stream>>>(op, nullptr, out, outer, inner, 0, k);
    MPT_CUDA_CHECK_LAUNCH("reduce_finalize_kernel");
    return;
  }
  const int64_t max_blocks = static_cast<int64_t>(l.sm_count) * (2048 / kThreads);
  dim3 block;
  int64_t blocks;
  Split split;
  if (inner == 1) {
    // Rows of up to 1024 elements: a warp each (8 rows per block); longer
    // rows: a block each.
    block = k <= 1024 ? dim3(32, kThreads / 32) : dim3(kThreads, 1);
    blocks = (outer + block.y - 1) / block.y;
    split = choose_split(l, blocks, k, 8 * block.x, 16 / sizeof(T));
  } else {
    unsigned x = 1;
    while (x < 32 && x < inner) x *= 2;
    block = dim3(x, kThreads / x);
    blocks = outer * ((inner + x - 1) / x);
    split = choose_split(l, blocks, k, 8 * block.y, 1);
  }
  // Every row starts 16-byte aligned when the first does and a row is a
  // whole number of 16-byte packs (chunks are multiples of packs already).
  const bool packed = inner == 1 && aligned_to(16, {in}) && (k * sizeof(T)) % 16 == 0;
  const dim3 grid(static_cast<unsigned>(std::min(blocks, max_blocks)), static_cast<unsigned>(split.splits));

  if (split.splits == 1) {
    if (inner == 1) reduce_rows_kernel<T><<<grid, block, 0, l.stream>>>(op, in, out, nullptr, outer, k, split, packed);
    else reduce_cols_kernel<T><<<grid, block, 0, l.stream>>>(op, in, out, nullptr, outer, k, inner, split);
    MPT_CUDA_CHECK_LAUNCH("reduce kernel");
    return;
  }
  Workspace ws(l, static_cast<size_t>(outer * split.splits * inner) * sizeof(Acc<A>));
  auto* partial = static_cast<Acc<A>*>(ws.get());
  if (inner == 1) reduce_rows_kernel<T><<<grid, block, 0, l.stream>>>(op, in, out, partial, outer, k, split, packed);
  else reduce_cols_kernel<T><<<grid, block, 0, l.stream>>>(op, in, out, partial, outer, k, inner, split);
  MPT_CUDA_CHECK_LAUNCH("reduce kernel");
  reduce_finalize_kernel<T><<<grid_for(l, outer * inner), kThreads, 0, l.stream>>>(op, partial, out, outer, inner,
                                                                                  split.splits, k);
  MPT_CUDA_CHECK_LAUNCH("reduce_finalize_kernel");
}

}  // namespace

void launch_reduce(const Launch& l, ReduceOp op, DType in_dtype, const void* in, void* out, int64_t outer, int64_t k,
                   int64_t inner) {
  dispatch_floating(in_dtype, reduce_op_name(op),
                    [&](auto tag) { reduce_typed<decltype(tag)>(l, op, in, out, outer, k, inner); });
}

}  // namespace mpt::cuda
