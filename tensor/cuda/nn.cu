// Row gathers/scatters (embedding) and max pooling on CUDA.
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

__device__ __forceinline__ void atomic_add(float* p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(double* p, double v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(__half* p, float v) { atomicAdd(p, __float2half_rn(v)); }
// Needs sm_80, the oldest architecture this project builds for.
__device__ __forceinline__ void atomic_add(__nv_bfloat16* p, float v) { atomicAdd(p, __float2bfloat16_rn(v)); }

// Repeated indices meet in atomics, so the order of additions (and, in
// 16-bit and f32, the rounding) may differ from run to run.
template <typename T>
__global__ void scatter_add_rows_kernel(T* __restrict__ table, const int64_t* __restrict__ idx,
                                        const T* __restrict__ src, int64_t rows, int64_t n, int64_t d) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t r = idx[i];
    if (r < 0 || r >= rows) continue;  // reported by the index check; never write outside the table
    T* dst = table + r * d;
    const T* s = src + i * d;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) atomic_add(dst + j, Element<T>::load(s[j]));
  }
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

void launch_scatter_add_rows(const Launch& l, DType dtype, void* table, const int64_t* idx, const void* src,
                             int64_t rows, int64_t n, int64_t d) {
  dispatch_floating(dtype, "index_add_rows", [&](auto tag) {
    using T = decltype(tag);
    scatter_add_rows_kernel<T><<<row_blocks(n), row_threads(d), 0, l.stream>>>(
        static_cast<T*>(table), idx, static_cast<const T*>(src), rows, n, d);
  });
  MPT_CUDA_CHECK_LAUNCH("scatter_add_rows_kernel");
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
