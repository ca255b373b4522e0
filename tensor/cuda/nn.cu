// Row gathers/scatters (embedding) and max pooling on CUDA.
#include <cub/device/device_radix_sort.cuh>

#include "tensor/cuda/kernel_utils.cuh"

namespace mpt::cuda {
namespace {

// One block row per index; threads stride over the row's columns. Rows are
// moved as raw elements of `T`, so any dtype of that size works.
template <typename T>
__global__ void gather_rows_kernel(T* __restrict__ out, const T* __restrict__ table, const int64_t* __restrict__ idx,
                                   int64_t rows, int64_t n, int64_t d) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t r = idx[i];
    T* dst = out + i * d;
    // A bad index was reported by the index check; never read outside the table.
    if (r < 0 || r >= rows) {
      for (int64_t j = threadIdx.x; j < d; j += blockDim.x) dst[j] = T{};
      continue;
    }
    const T* src = table + r * d;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) dst[j] = src[j];
  }
}

// Scatter-add in a fixed order (table[idx[i]] += src[i]), as PyTorch's
// embedding backward sums: the indices are sorted (stably, so equal ones
// keep their positions' order), the sorted list is cut into chunks of
// kScatterChunk, and each chunk sums its runs of one row in order. A run
// that is a row's whole share (the row's indices all in this chunk) is added
// to the table there; a row whose indices cross chunk boundaries leaves its
// pieces in two slots a chunk (the piece that goes on from the chunk before,
// and the one that goes on into the next), which a second kernel adds up in
// chunk order for the chunk where the row starts. Each table row is written
// by one thread a column, so the sums come out the same bits every run
// (atomics, which this replaced, added in whatever order threads came).
constexpr int64_t kScatterChunk = 32;

// Grid: one block a chunk; threads over the columns. `head` and `tail` are
// [chunks, d] in the accumulation type A.
template <typename T, typename A>
__global__ void scatter_chunk_sums_kernel(T* __restrict__ table, const int64_t* __restrict__ key,
                                          const int64_t* __restrict__ pos, const T* __restrict__ src,
                                          A* __restrict__ head, A* __restrict__ tail, int64_t rows, int64_t n,
                                          int64_t d) {
  const int64_t c = blockIdx.x;
  const int64_t begin = c * kScatterChunk, end = n < begin + kScatterChunk ? n : begin + kScatterChunk;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    int64_t start = begin;
    A acc = 0;
    for (int64_t k = begin; k < end; ++k) {
      acc += static_cast<A>(Element<T>::load(src[pos[k] * d + j]));
      if (k + 1 < end && key[k + 1] == key[k]) continue;
      // A run of one row ends at k.
      const int64_t r = key[k];
      const bool from_before = start == begin && begin > 0 && key[begin - 1] == r;
      const bool into_next = k + 1 == end && end < n && key[end] == r;
      if (from_before) {
        head[c * d + j] = acc;
      } else if (into_next) {
        tail[c * d + j] = acc;
      } else if (r >= 0 && r < rows) {  // a bad index is reported by the index check; never write outside
        T* dst = table + r * d + j;
        *dst = Element<T>::store(static_cast<A>(Element<T>::load(*dst)) + acc);
      }
      start = k + 1;
      acc = 0;
    }
  }
}

// Grid: one block a chunk; the chunks where a row that goes on into the next
// chunks starts add its pieces in order and write the row.
template <typename T, typename A>
__global__ void scatter_chunk_carry_kernel(T* __restrict__ table, const int64_t* __restrict__ key,
                                           const A* __restrict__ head, const A* __restrict__ tail, int64_t rows,
                                           int64_t n, int64_t d) {
  const int64_t c = blockIdx.x;
  const int64_t begin = c * kScatterChunk, end = n < begin + kScatterChunk ? n : begin + kScatterChunk;
  const int64_t r = key[end - 1];
  const bool into_next = end < n && key[end] == r;
  const bool whole_chunk_from_before = begin > 0 && key[begin - 1] == r;  // keys are sorted
  if (!into_next || whole_chunk_from_before || r < 0 || r >= rows) return;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    A acc = tail[c * d + j];
    for (int64_t next = c + 1;; ++next) {
      acc += head[next * d + j];
      const int64_t next_end = n < (next + 1) * kScatterChunk ? n : (next + 1) * kScatterChunk;
      if (!(next_end < n && key[next_end - 1] == r && key[next_end] == r)) break;
    }
    T* dst = table + r * d + j;
    *dst = Element<T>::store(static_cast<A>(Element<T>::load(*dst)) + acc);
  }
}

// Where each part of the scratch lies (256-byte aligned).
struct ScatterScratch {
  size_t keys, pos_in, pos_out, head, tail, sort, total;
  ScatterScratch(int64_t n, int64_t d, size_t acc_size, size_t sort_bytes) {
    const auto round = [](size_t b) { return (b + 255) / 256 * 256; };
    const int64_t chunks = (n + kScatterChunk - 1) / kScatterChunk;
    const size_t idx_bytes = round(sizeof(int64_t) * static_cast<size_t>(n));
    const size_t slot_bytes = round(acc_size * static_cast<size_t>(chunks * d));
    keys = 0;
    pos_in = keys + idx_bytes;
    pos_out = pos_in + idx_bytes;
    head = pos_out + idx_bytes;
    tail = head + slot_bytes;
    sort = tail + slot_bytes;
    total = sort + round(sort_bytes);
  }
};

// Bits the sort must look at for keys in [0, rows).
int sort_bits(int64_t rows) {
  int bits = 1;
  while (bits < 63 && (int64_t{1} << bits) < rows) ++bits;
  return bits;
}

size_t radix_sort_bytes(int64_t n, int64_t rows) {
  size_t bytes = 0;
  MPT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const int64_t*>(nullptr),
                                                 static_cast<int64_t*>(nullptr), static_cast<const int64_t*>(nullptr),
                                                 static_cast<int64_t*>(nullptr), n, 0, sort_bits(rows)));
  return bytes;
}

struct PoolGeometry {
  int64_t planes, h, w, ho, wo;
  Pool2dParams p;
};

// The pooling kernels index in `I`: int32_t whenever the tensors are small
// enough (64-bit division costs several times a 32-bit one, and the
// kernels do little else), int64_t otherwise.
template <typename I>
struct Pool {
  I h, w, ho, wo, kh, kw, sh, sw, ph, pw;
  __device__ explicit Pool(const PoolGeometry& g)
      : h(I(g.h)), w(I(g.w)), ho(I(g.ho)), wo(I(g.wo)), kh(I(g.p.kernel_h)), kw(I(g.p.kernel_w)),
        sh(I(g.p.stride_h)), sw(I(g.p.stride_w)), ph(I(g.p.pad_h)), pw(I(g.p.pad_w)) {}
};

// f(y * w + x) for each input element (y, x) of window (oy, ox) that lies
// inside the plane (not in the padding), row by row.
template <typename I, typename F>
__device__ __forceinline__ void for_each_in_window(const Pool<I>& g, I oy, I ox, F f) {
  for (I ky = 0; ky < g.kh; ++ky) {
    const I y = oy * g.sh - g.ph + ky;
    if (y < 0 || y >= g.h) continue;
    for (I kx = 0; kx < g.kw; ++kx) {
      const I x = ox * g.sw - g.pw + kx;
      if (x >= 0 && x < g.w) f(y * g.w + x);
    }
  }
}

template <typename T, typename I>
__global__ void max_pool_forward_kernel(T* __restrict__ out, int64_t* __restrict__ indices, const T* __restrict__ x,
                                        PoolGeometry geometry, I total) {
  using C = typename Element<T>::Compute;
  const Pool<I> g(geometry);
  for (I k = I(blockIdx.x) * I(blockDim.x) + I(threadIdx.x); k < total; k += I(gridDim.x) * I(blockDim.x)) {
    const I ox = k % g.wo, rest = k / g.wo, oy = rest % g.ho, plane = rest / g.ho;
    const T* in = x + int64_t(plane) * g.h * g.w;
    C best = -INFINITY;
    I best_at = -1;
    for_each_in_window(g, oy, ox, [&](I at) {
      const C v = Element<T>::load(in[at]);
      // The first maximum wins, and NaN beats everything, as on the CPU.
      if (best_at < 0 || v > best || (v != v && best == best)) {
        best = v;
        best_at = at;
      }
    });
    out[k] = Element<T>::store(best);
    indices[k] = best_at;
  }
}

// Overlapping windows: one thread per input element sums the gradients of
// the windows that chose it: a gather, so no atomics and the same sum
// order on every run.
template <typename T, typename I>
__global__ void max_pool_backward_gather_kernel(T* __restrict__ grad_x, const T* __restrict__ grad_out,
                                                const int64_t* __restrict__ indices, PoolGeometry geometry, I total) {
  using C = typename Element<T>::Compute;
  const Pool<I> g(geometry);
  for (I k = I(blockIdx.x) * I(blockDim.x) + I(threadIdx.x); k < total; k += I(gridDim.x) * I(blockDim.x)) {
    const I x = k % g.w, rest = k / g.w, y = rest % g.h, plane = rest / g.h;
    const I here = y * g.w + x;
    // Output rows/columns whose windows cover (y, x).
    const I oy_lo = max(I(0), (y + g.ph - g.kh + g.sh) / g.sh);
    const I oy_hi = min(g.ho - 1, (y + g.ph) / g.sh);
    const I ox_lo = max(I(0), (x + g.pw - g.kw + g.sw) / g.sw);
    const I ox_hi = min(g.wo - 1, (x + g.pw) / g.sw);
    const int64_t base = int64_t(plane) * g.ho * g.wo;
    C acc = 0;
    for (I oy = oy_lo; oy <= oy_hi; ++oy)
      for (I ox = ox_lo; ox <= ox_hi; ++ox) {
        const int64_t o = base + oy * g.wo + ox;
        if (indices[o] == here) acc += Element<T>::load(grad_out[o]);
      }
    grad_x[k] = Element<T>::store(acc);
  }
}

// Windows that do not overlap (stride >= kernel, the usual 2x2 pooling):
// each input element lies in at most one window, so one thread per window
// writes all of it, the window's gradient where its maximum was and zero
// elsewhere. Each index and gradient is read once, where the gather reads
// them once per element of the window.
template <typename T, typename I>
__global__ void max_pool_backward_windows_kernel(T* __restrict__ grad_x, const T* __restrict__ grad_out,
                                                 const int64_t* __restrict__ indices, PoolGeometry geometry, I total) {
  const Pool<I> g(geometry);
  for (I k = I(blockIdx.x) * I(blockDim.x) + I(threadIdx.x); k < total; k += I(gridDim.x) * I(blockDim.x)) {
    const I ox = k % g.wo, rest = k / g.wo, oy = rest % g.ho, plane = rest / g.ho;
    const I chosen = I(indices[k]);
    const T grad = grad_out[k];
    T* out = grad_x + int64_t(plane) * g.h * g.w;
    for_each_in_window(g, oy, ox, [&](I at) { out[at] = at == chosen ? grad : T{}; });
  }
}

// 32-bit indexing when every index, and a grid-stride step past the last,
// stays below 2^31.
bool fits_int32(const PoolGeometry& g) {
  const int64_t limit = int64_t(1) << 30;
  return g.planes * g.h * g.w < limit && g.planes * g.ho * g.wo < limit;
}

unsigned row_threads(int64_t d) { return static_cast<unsigned>(std::min<int64_t>(256, std::max<int64_t>(32, d))); }
unsigned row_blocks(int64_t n) { return static_cast<unsigned>(std::min<int64_t>(n, 65535)); }

}  // namespace

void launch_gather_rows(const Launch& l, void* out, const void* table, const int64_t* idx, size_t element_size,
                        int64_t rows, int64_t n, int64_t d) {
  auto go = [&](auto tag) {
    using T = decltype(tag);
    gather_rows_kernel<T><<<row_blocks(n), row_threads(d), 0, l.stream>>>(
        static_cast<T*>(out), static_cast<const T*>(table), idx, rows, n, d);
  };
  switch (element_size) {
    case 1: go(uint8_t{}); break;
    case 2: go(uint16_t{}); break;
    case 4: go(uint32_t{}); break;
    default: go(uint64_t{}); break;
  }
  MPT_CUDA_CHECK_LAUNCH("gather_rows_kernel");
}

size_t scatter_add_rows_scratch_bytes(DType dtype, int64_t rows, int64_t n, int64_t d) {
  if (n == 0 || d == 0) return 0;
  const size_t acc_size = dtype == DType::f64 ? sizeof(double) : sizeof(float);
  return ScatterScratch(n, d, acc_size, radix_sort_bytes(n, rows)).total;
}

void launch_scatter_add_rows(const Launch& l, DType dtype, void* table, const int64_t* idx, const void* src,
                             int64_t rows, int64_t n, int64_t d, void* scratch) {
  if (n == 0 || d == 0) return;
  dispatch_floating(dtype, "index_add_rows", [&](auto tag) {
    using T = decltype(tag);
    using A = typename Element<T>::Compute;
    size_t sort_bytes = radix_sort_bytes(n, rows);
    const ScatterScratch at(n, d, sizeof(A), sort_bytes);
    char* base = static_cast<char*>(scratch);
    auto* keys = reinterpret_cast<int64_t*>(base + at.keys);
    auto* pos_in = reinterpret_cast<int64_t*>(base + at.pos_in);
    auto* pos_out = reinterpret_cast<int64_t*>(base + at.pos_out);
    auto* head = reinterpret_cast<A*>(base + at.head);
    auto* tail = reinterpret_cast<A*>(base + at.tail);
    launch_arange(l, pos_in, DType::i64, n, 0, 1);  // each index's position, sorted along with it
    MPT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(base + at.sort, sort_bytes, idx, keys, pos_in, pos_out, n, 0,
                                                   sort_bits(rows), l.stream));
    const auto chunks = static_cast<unsigned>((n + kScatterChunk - 1) / kScatterChunk);
    scatter_chunk_sums_kernel<T, A><<<chunks, row_threads(d), 0, l.stream>>>(
        static_cast<T*>(table), keys, pos_out, static_cast<const T*>(src), head, tail, rows, n, d);
    MPT_CUDA_CHECK_LAUNCH("scatter_chunk_sums_kernel");
    scatter_chunk_carry_kernel<T, A><<<chunks, row_threads(d), 0, l.stream>>>(static_cast<T*>(table), keys, head,
                                                                               tail, rows, n, d);
    MPT_CUDA_CHECK_LAUNCH("scatter_chunk_carry_kernel");
  });
}

void launch_max_pool2d_forward(const Launch& l, DType dtype, void* out, int64_t* indices, const void* x,
                               const int64_t* x_shape, int64_t ho, int64_t wo, const Pool2dParams& p) {
  const PoolGeometry g{x_shape[0] * x_shape[1], x_shape[2], x_shape[3], ho, wo, p};
  const int64_t total = g.planes * ho * wo;
  dispatch_floating(dtype, "max_pool2d", [&](auto tag) {
    using T = decltype(tag);
    auto go = [&](auto index) {
      using I = decltype(index);
      max_pool_forward_kernel<T, I><<<grid_for(l, total), kThreads, 0, l.stream>>>(
          static_cast<T*>(out), indices, static_cast<const T*>(x), g, I(total));
    };
    fits_int32(g) ? go(int32_t{}) : go(int64_t{});
  });
  MPT_CUDA_CHECK_LAUNCH("max_pool_forward_kernel");
}

void launch_max_pool2d_backward(const Launch& l, DType dtype, void* grad_x, const void* grad_out,
                                const int64_t* indices, const int64_t* x_shape, int64_t ho, int64_t wo,
                                const Pool2dParams& p) {
  const PoolGeometry g{x_shape[0] * x_shape[1], x_shape[2], x_shape[3], ho, wo, p};
  const bool disjoint = p.stride_h >= p.kernel_h && p.stride_w >= p.kernel_w;
  // Disjoint windows that cover the input exactly leave no element unwritten.
  const bool tiled = disjoint && p.stride_h == p.kernel_h && p.stride_w == p.kernel_w && p.pad_h == 0 &&
                     p.pad_w == 0 && ho * p.kernel_h == g.h && wo * p.kernel_w == g.w;
  dispatch_floating(dtype, "max_pool2d backward", [&](auto tag) {
    using T = decltype(tag);
    auto go = [&](auto index) {
      using I = decltype(index);
      if (!disjoint) {
        const int64_t total = g.planes * g.h * g.w;
        max_pool_backward_gather_kernel<T, I><<<grid_for(l, total), kThreads, 0, l.stream>>>(
            static_cast<T*>(grad_x), static_cast<const T*>(grad_out), indices, g, I(total));
        return;
      }
      if (!tiled) MPT_CUDA_CHECK(cudaMemsetAsync(grad_x, 0, sizeof(T) * g.planes * g.h * g.w, l.stream));
      const int64_t total = g.planes * ho * wo;
      max_pool_backward_windows_kernel<T, I><<<grid_for(l, total), kThreads, 0, l.stream>>>(
          static_cast<T*>(grad_x), static_cast<const T*>(grad_out), indices, g, I(total));
    };
    fits_int32(g) ? go(int32_t{}) : go(int64_t{});
  });
  MPT_CUDA_CHECK_LAUNCH("max_pool_backward_kernel");
}

}  // namespace mpt::cuda
