// Fused batch norm over x [n, c, s]. Each channel's n * s elements are cut
// into stretches, one block a (channel, stretch); the blocks write partial
// results that one small kernel combines per channel in a fixed order (no
// atomics: the same bits every run). Then one element-wise pass.
// - Forward: Welford's mean and squared deviations per thread, combined by
//   Chan's rule across threads and blocks (no cancellation for data far
//   from zero, as sums of squares would have); the combine writes mean and
//   1/std and blends the running statistics; the pass writes y.
// - Backward: sums of dy and dy * (x - mean) per channel; the combine
//   writes the parameter gradients and the three coefficients of
//   dx = a * dy + b * (x - mean) + d; the pass writes dx.
// Only x's mean and 1/std per channel are saved for backward, where the
// composed form kept a normalised copy of x in f32.
#include <algorithm>

#include "tensor/cuda/batch_norm.h"
#include "tensor/cuda/kernel_utils.cuh"

namespace mpt::cuda {
namespace {

// Element j of one channel's n * s elements, and the channel of element e
// of x, with 32-bit division by multiplication where the sizes allow.
struct ChannelIndex {
  int64_t c = 0, s = 0;
  FastDivisor by_s, by_c;
  bool fast = false;  // every index below 2^31

  ChannelIndex(int64_t n, int64_t c, int64_t s) : c(c), s(s), fast(n * c * s < (int64_t(1) << 31)) {
    if (fast) {
      by_s = FastDivisor(static_cast<uint32_t>(s));
      by_c = FastDivisor(static_cast<uint32_t>(c));
    }
  }
  __device__ __forceinline__ int64_t offset(int64_t channel, int64_t j) const {
    const int64_t sample = fast ? divide(by_s, static_cast<uint32_t>(j)) : j / s;
    return (sample * c + channel) * s + (j - sample * s);
  }
  __device__ __forceinline__ int64_t channel_of(int64_t e) const {
    if (!fast) return (e / s) % c;
    const uint32_t plane = divide(by_s, static_cast<uint32_t>(e));
    return plane - divide(by_c, plane) * static_cast<uint32_t>(c);
  }
};

// How a channel's elements are cut: `stretches` blocks of `chunk` elements.
struct Stretches {
  int64_t stretches = 1, chunk = 0;
};

Stretches stretches_for(const Launch& l, const BatchNormArgs& a) {
  const int64_t m = a.n * a.s;
  // At least 8 elements a thread, and about 8 blocks an SM over all channels.
  const int64_t by_size = std::max<int64_t>(1, (m + kThreads * 8 - 1) / (kThreads * 8));
  const int64_t to_fill = std::max<int64_t>(1, (8 * static_cast<int64_t>(l.sm_count) + a.c - 1) / a.c);
  const int64_t k = std::min<int64_t>({by_size, to_fill, 65535});  // (the grid's y dimension)
  return {k, (m + k - 1) / k};
}

// Scratch layout: per-block partials [c][stretches][kPartial], then the
// backward's coefficients of dx [c][kCoefficients].
constexpr int kPartial = 3;
constexpr int kCoefficients = 3;

struct Welford {
  float count = 0.0f, mean = 0.0f, m2 = 0.0f;

  __device__ __forceinline__ void add(float v) {
    count += 1.0f;
    const float delta = v - mean;
    mean += delta / count;
    m2 += delta * (v - mean);
  }
  // Chan et al.'s rule for the union of two disjoint sets.
  __device__ __forceinline__ static Welford combine(const Welford& a, const Welford& b) {
    if (b.count == 0.0f) return a;
    if (a.count == 0.0f) return b;
    const float count = a.count + b.count, delta = b.mean - a.mean, share = b.count / count;
    return {count, a.mean + delta * share, a.m2 + b.m2 + delta * delta * a.count * share};
  }
};

__device__ __forceinline__ Welford warp_welford(Welford v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    const Welford other{__shfl_down_sync(0xffffffffu, v.count, o), __shfl_down_sync(0xffffffffu, v.mean, o),
                        __shfl_down_sync(0xffffffffu, v.m2, o)};
    v = Welford::combine(v, other);
  }
  return v;  // lane 0's is the warp's
}

// The block's result in thread 0, combined in a fixed order.
__device__ __forceinline__ Welford block_welford(Welford v) {
  __shared__ Welford warps[kThreads / 32];
  v = warp_welford(v);
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x >= 32) return v;
  return warp_welford(threadIdx.x < kThreads / 32 ? warps[threadIdx.x] : Welford{});
}

__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warps[kThreads / 32];
  __syncthreads();  // (a second call in one kernel reuses `warps`)
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = v;
  __syncthreads();
  return warp_sum(threadIdx.x < kThreads / 32 ? warps[threadIdx.x] : 0.0f);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    batch_norm_statistics_kernel(float* __restrict__ partials, const T* __restrict__ x, ChannelIndex index,
                                 int64_t m, int64_t chunk) {
  const int64_t channel = blockIdx.x, begin = blockIdx.y * chunk, end = std::min(m, begin + chunk);
  Welford acc;
  for (int64_t j = begin + threadIdx.x; j < end; j += kThreads) acc.add(Element<T>::load(x[index.offset(channel, j)]));
  acc = block_welford(acc);
  if (threadIdx.x == 0) {
    float* p = partials + (channel * gridDim.y + blockIdx.y) * kPartial;
    p[0] = acc.count;
    p[1] = acc.mean;
    p[2] = acc.m2;
  }
}

// One thread a channel: its blocks' partials in order, in f64.
__global__ void batch_norm_combine_statistics_kernel(float* __restrict__ mean, float* __restrict__ rstd,
                                                     float* __restrict__ running_mean,
                                                     float* __restrict__ running_var,
                                                     const float* __restrict__ partials, int64_t c,
                                                     int64_t stretches, int64_t m, double momentum, double eps) {
  for (int64_t channel = global_thread(); channel < c; channel += grid_threads()) {
    double count = 0.0, mu = 0.0, m2 = 0.0;
    for (int64_t k = 0; k < stretches; ++k) {
      const float* p = partials + (channel * stretches + k) * kPartial;
      const double n_b = p[0];
      if (n_b == 0.0) continue;
      const double total = count + n_b, delta = p[1] - mu;
      mu += delta * n_b / total;
      m2 += p[2] + delta * delta * count * n_b / total;
      count = total;
    }
    const double var = m2 / static_cast<double>(m);  // biased: what normalises
    mean[channel] = static_cast<float>(mu);
    rstd[channel] = 1.0f / sqrtf(static_cast<float>(var) + static_cast<float>(eps));
    if (running_mean) {
      const double unbiased = var * static_cast<double>(m) / static_cast<double>(m - 1);
      running_mean[channel] = static_cast<float>((1.0 - momentum) * running_mean[channel] + momentum * mu);
      running_var[channel] = static_cast<float>((1.0 - momentum) * running_var[channel] + momentum * unbiased);
    }
  }
}

__global__ void batch_norm_running_statistics_kernel(float* __restrict__ mean, float* __restrict__ rstd,
                                                     const float* __restrict__ running_mean,
                                                     const float* __restrict__ running_var, int64_t c, float eps) {
  for (int64_t channel = global_thread(); channel < c; channel += grid_threads()) {
    mean[channel] = running_mean[channel];
    rstd[channel] = 1.0f / sqrtf(running_var[channel] + eps);
  }
}

// V elements a thread at a time where s is a multiple of V (a Pack never
// spans two channels) and the pointers allow it.
template <typename T>
int pack_width(const BatchNormArgs& a, std::initializer_list<const void*> ptrs) {
  for (int v = 16 / static_cast<int>(sizeof(T)); v > 1; v /= 2)
    if (a.s % v == 0 && aligned_to(v * sizeof(T), ptrs)) return v;
  return 1;
}

// Calls f.template operator()<T, V>() for x's dtype and the Pack width.
template <typename F>
void dispatch_packed(const BatchNormArgs& a, std::initializer_list<const void*> ptrs, const char* op, F&& f) {
  dispatch_floating<false>(a.dtype, op, [&](auto t) {
    using T = decltype(t);
    switch (pack_width<T>(a, ptrs)) {
      case 8: if constexpr (sizeof(T) == 2) return f.template operator()<T, 8>(); [[fallthrough]];
      case 4: return f.template operator()<T, 4>();
      case 2: return f.template operator()<T, 2>();
      default: return f.template operator()<T, 1>();
    }
  });
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    batch_norm_apply_kernel(T* __restrict__ y, const T* __restrict__ x, const float* __restrict__ mean,
                            const float* __restrict__ rstd, const float* __restrict__ weight,
                            const float* __restrict__ bias, ChannelIndex index, int64_t packs) {
  for (int64_t i = global_thread(); i < packs; i += grid_threads()) {
    const int64_t channel = index.channel_of(i * V);
    const float mu = mean[channel], r = rstd[channel];
    const float w = weight ? weight[channel] : 1.0f, b = bias ? bias[channel] : 0.0f;
    const Pack<T, V> in = reinterpret_cast<const Pack<T, V>*>(x)[i];
    Pack<T, V> out;
#pragma unroll
    for (int j = 0; j < V; ++j) out.v[j] = Element<T>::store((Element<T>::load(in.v[j]) - mu) * r * w + b);
    reinterpret_cast<Pack<T, V>*>(y)[i] = out;
  }
}

// Per block: the sums of dy and of dy * (x - mean) over its stretch.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    batch_norm_backward_sums_kernel(float* __restrict__ partials, const T* __restrict__ dy,
                                    const T* __restrict__ x, const float* __restrict__ mean, ChannelIndex index,
                                    int64_t m, int64_t chunk) {
  const int64_t channel = blockIdx.x, begin = blockIdx.y * chunk, end = std::min(m, begin + chunk);
  const float mu = mean[channel];
  float sum_dy = 0.0f, sum_dy_centered = 0.0f;
  for (int64_t j = begin + threadIdx.x; j < end; j += kThreads) {
    const int64_t o = index.offset(channel, j);
    const float g = Element<T>::load(dy[o]);
    sum_dy += g;
    sum_dy_centered += g * (Element<T>::load(x[o]) - mu);
  }
  sum_dy = block_sum(sum_dy);
  sum_dy_centered = block_sum(sum_dy_centered);
  if (threadIdx.x == 0) {
    float* p = partials + (channel * gridDim.y + blockIdx.y) * kPartial;
    p[0] = sum_dy;
    p[1] = sum_dy_centered;
  }
}

// One thread a channel: the parameter gradients and dx's coefficients.
__global__ void batch_norm_combine_backward_kernel(float* __restrict__ coefficients, float* __restrict__ grad_weight,
                                                   float* __restrict__ grad_bias, const float* __restrict__ partials,
                                                   const float* __restrict__ rstd, const float* __restrict__ weight,
                                                   int64_t c, int64_t stretches, int64_t m, bool batch_statistics) {
  for (int64_t channel = global_thread(); channel < c; channel += grid_threads()) {
    double sum_dy = 0.0, sum_dy_centered = 0.0;
    if (partials)
      for (int64_t k = 0; k < stretches; ++k) {
        const float* p = partials + (channel * stretches + k) * kPartial;
        sum_dy += p[0];
        sum_dy_centered += p[1];
      }
    const double r = rstd[channel], sum_dy_xhat = sum_dy_centered * r;
    if (grad_weight) grad_weight[channel] = static_cast<float>(sum_dy_xhat);
    if (grad_bias) grad_bias[channel] = static_cast<float>(sum_dy);
    // dx = w r (dy - mean(dy) - xhat mean(dy xhat)) with batch statistics,
    // w r dy with running ones.
    const double scale = (weight ? weight[channel] : 1.0) * r;
    float* k = coefficients + channel * kCoefficients;
    k[0] = static_cast<float>(scale);
    k[1] = batch_statistics ? static_cast<float>(-scale * r * sum_dy_xhat / static_cast<double>(m)) : 0.0f;
    k[2] = batch_statistics ? static_cast<float>(-scale * sum_dy / static_cast<double>(m)) : 0.0f;
  }
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    batch_norm_backward_dx_kernel(T* __restrict__ dx, const T* __restrict__ dy, const T* __restrict__ x,
                                  const float* __restrict__ mean, const float* __restrict__ coefficients,
                                  ChannelIndex index, int64_t packs) {
  for (int64_t i = global_thread(); i < packs; i += grid_threads()) {
    const int64_t channel = index.channel_of(i * V);
    const float* k = coefficients + channel * kCoefficients;
    const float mu = mean[channel], a = k[0], b = k[1], d = k[2];
    const Pack<T, V> g = reinterpret_cast<const Pack<T, V>*>(dy)[i];
    const Pack<T, V> in = reinterpret_cast<const Pack<T, V>*>(x)[i];
    Pack<T, V> out;
#pragma unroll
    for (int j = 0; j < V; ++j)
      out.v[j] = Element<T>::store(a * Element<T>::load(g.v[j]) + b * (Element<T>::load(in.v[j]) - mu) + d);
    reinterpret_cast<Pack<T, V>*>(dx)[i] = out;
  }
}

// Floats of the per-block partials, which the backward's coefficients follow.
int64_t partial_floats(const BatchNormArgs& a, const Stretches& st) { return a.c * st.stretches * kPartial; }

}  // namespace

bool fused_batch_norm_supported(DType dtype) {
  return dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16;
}

size_t batch_norm_scratch_bytes(const Launch& l, const BatchNormArgs& a) {
  return static_cast<size_t>(partial_floats(a, stretches_for(l, a)) + a.c * kCoefficients) * sizeof(float);
}

void launch_batch_norm_statistics(const Launch& l, const BatchNormArgs& a, float* running_mean, float* running_var,
                                  double momentum, double eps, void* scratch) {
  const Stretches st = stretches_for(l, a);
  float* partials = static_cast<float*>(scratch);
  const dim3 grid(static_cast<unsigned>(a.c), static_cast<unsigned>(st.stretches));
  dispatch_floating<false>(a.dtype, "batch_norm", [&](auto t) {
    using T = decltype(t);
    batch_norm_statistics_kernel<T><<<grid, kThreads, 0, l.stream>>>(
        partials, static_cast<const T*>(a.x), ChannelIndex(a.n, a.c, a.s), a.n * a.s, st.chunk);
  });
  MPT_CUDA_CHECK_LAUNCH("batch_norm_statistics_kernel");
  batch_norm_combine_statistics_kernel<<<grid_for(l, a.c), kThreads, 0, l.stream>>>(
      a.mean, a.rstd, running_mean, running_var, partials, a.c, st.stretches, a.n * a.s, momentum, eps);
  MPT_CUDA_CHECK_LAUNCH("batch_norm_combine_statistics_kernel");
}

void launch_batch_norm_running_statistics(const Launch& l, const BatchNormArgs& a, const float* running_mean,
                                          const float* running_var, double eps) {
  batch_norm_running_statistics_kernel<<<grid_for(l, a.c), kThreads, 0, l.stream>>>(
      a.mean, a.rstd, running_mean, running_var, a.c, static_cast<float>(eps));
  MPT_CUDA_CHECK_LAUNCH("batch_norm_running_statistics_kernel");
}

void launch_batch_norm_apply(const Launch& l, const BatchNormArgs& a, void* y) {
  const int64_t total = a.n * a.c * a.s;
  if (total == 0) return;
  dispatch_packed(a, {a.x, y}, "batch_norm", [&]<typename T, int V>() {
    batch_norm_apply_kernel<T, V><<<grid_for(l, total / V), kThreads, 0, l.stream>>>(
        static_cast<T*>(y), static_cast<const T*>(a.x), a.mean, a.rstd, a.weight, a.bias,
        ChannelIndex(a.n, a.c, a.s), total / V);
  });
  MPT_CUDA_CHECK_LAUNCH("batch_norm_apply_kernel");
}

void launch_batch_norm_backward(const Launch& l, const BatchNormArgs& a, const void* dy, void* dx, float* grad_weight,
                                float* grad_bias, bool batch_statistics, void* scratch) {
  const Stretches st = stretches_for(l, a);
  const int64_t m = a.n * a.s;
  float* partials = nullptr;
  if (m > 0 && (grad_weight || grad_bias || (dx && batch_statistics))) {
    partials = static_cast<float*>(scratch);
    const dim3 grid(static_cast<unsigned>(a.c), static_cast<unsigned>(st.stretches));
    dispatch_floating<false>(a.dtype, "batch_norm backward", [&](auto t) {
      using T = decltype(t);
      batch_norm_backward_sums_kernel<T><<<grid, kThreads, 0, l.stream>>>(
          partials, static_cast<const T*>(dy), static_cast<const T*>(a.x), a.mean, ChannelIndex(a.n, a.c, a.s), m,
          st.chunk);
    });
    MPT_CUDA_CHECK_LAUNCH("batch_norm_backward_sums_kernel");
  }
  float* coefficients = static_cast<float*>(scratch) + partial_floats(a, st);
  batch_norm_combine_backward_kernel<<<grid_for(l, a.c), kThreads, 0, l.stream>>>(
      coefficients, grad_weight, grad_bias, partials, a.rstd, a.weight, a.c, st.stretches, m, batch_statistics);
  MPT_CUDA_CHECK_LAUNCH("batch_norm_combine_backward_kernel");
  const int64_t total = m * a.c;
  if (!dx || total == 0) return;
  dispatch_packed(a, {a.x, dy, dx}, "batch_norm backward", [&]<typename T, int V>() {
    batch_norm_backward_dx_kernel<T, V><<<grid_for(l, total / V), kThreads, 0, l.stream>>>(
        static_cast<T*>(dx), static_cast<const T*>(dy), static_cast<const T*>(a.x), a.mean, coefficients,
        ChannelIndex(a.n, a.c, a.s), total / V);
  });
  MPT_CUDA_CHECK_LAUNCH("batch_norm_backward_dx_kernel");
}

}  // namespace mpt::cuda
