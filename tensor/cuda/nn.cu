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

template <typename T>
__global__ void max_pool_forward_kernel(T* __restrict__ out, int64_t* __restrict__ indices, const T* __restrict__ x,
                                        PoolGeometry g) {
  using C = typename Element<T>::Compute;
  const int64_t total = g.planes * g.ho * g.wo;
  for (int64_t k = global_thread(); k < total; k += grid_threads()) {
    const int64_t ox = k % g.wo, oy = (k / g.wo) % g.ho, plane = k / (g.wo * g.ho);
    const T* in = x + plane * g.h * g.w;
    C best = -INFINITY;
    int64_t best_at = -1;
    for (int64_t ky = 0; ky < g.p.kernel_h; ++ky) {
      const int64_t y = oy * g.p.stride_h - g.p.pad_h + ky;
      if (y < 0 || y >= g.h) continue;
      for (int64_t kx = 0; kx < g.p.kernel_w; ++kx) {
        const int64_t xx = ox * g.p.stride_w - g.p.pad_w + kx;
        if (xx < 0 || xx >= g.w) continue;
        const C v = Element<T>::load(in[y * g.w + xx]);
        // The first maximum wins, and NaN beats everything, as on the CPU.
        if (best_at < 0 || v > best || (v != v && best == best)) {
          best = v;
          best_at = y * g.w + xx;
        }
      }
    }
    out[k] = Element<T>::store(best);
    indices[k] = best_at;
  }
}

// One thread per input element sums the gradients of the windows that chose
// it: a gather, so no atomics and the same sum order on every run.
template <typename T>
__global__ void max_pool_backward_kernel(T* __restrict__ grad_x, const T* __restrict__ grad_out,
                                         const int64_t* __restrict__ indices, PoolGeometry g) {
  using C = typename Element<T>::Compute;
  const int64_t total = g.planes * g.h * g.w;
  for (int64_t k = global_thread(); k < total; k += grid_threads()) {
    const int64_t x = k % g.w, y = (k / g.w) % g.h, plane = k / (g.w * g.h);
    const int64_t here = y * g.w + x;
    // Output rows/columns whose windows cover (y, x).
    const int64_t oy_lo = max(int64_t(0), (y + g.p.pad_h - g.p.kernel_h + g.p.stride_h) / g.p.stride_h);
    const int64_t oy_hi = min(g.ho - 1, (y + g.p.pad_h) / g.p.stride_h);
    const int64_t ox_lo = max(int64_t(0), (x + g.p.pad_w - g.p.kernel_w + g.p.stride_w) / g.p.stride_w);
    const int64_t ox_hi = min(g.wo - 1, (x + g.p.pad_w) / g.p.stride_w);
    const int64_t base = plane * g.ho * g.wo;
    C acc = 0;
    for (int64_t oy = oy_lo; oy <= oy_hi; ++oy)
      for (int64_t ox = ox_lo; ox <= ox_hi; ++ox) {
        const int64_t o = base + oy * g.wo + ox;
        if (indices[o] == here) acc += Element<T>::load(grad_out[o]);
      }
    grad_x[k] = Element<T>::store(acc);
  }
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
  dispatch_floating(dtype, "max_pool2d", [&](auto tag) {
    using T = decltype(tag);
    max_pool_forward_kernel<T><<<grid_for(l, g.planes * ho * wo), kThreads, 0, l.stream>>>(
        static_cast<T*>(out), indices, static_cast<const T*>(x), g);
  });
  MPT_CUDA_CHECK_LAUNCH("max_pool_forward_kernel");
}

void launch_max_pool2d_backward(const Launch& l, DType dtype, void* grad_x, const void* grad_out,
                                const int64_t* indices, const int64_t* x_shape, int64_t ho, int64_t wo,
                                const Pool2dParams& p) {
  const PoolGeometry g{x_shape[0] * x_shape[1], x_shape[2], x_shape[3], ho, wo, p};
  dispatch_floating(dtype, "max_pool2d backward", [&](auto tag) {
    using T = decltype(tag);
    max_pool_backward_kernel<T><<<grid_for(l, g.planes * g.h * g.w), kThreads, 0, l.stream>>>(
        static_cast<T*>(grad_x), static_cast<const T*>(grad_out), indices, g);
  });
  MPT_CUDA_CHECK_LAUNCH("max_pool_backward_kernel");
}

}  // namespace mpt::cuda
