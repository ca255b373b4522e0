// Fused layer norm over the last dimension: one warp per row, the row held
// in registers (each lane owns columns lane, lane + 32, ...), statistics in
// f32. Forward writes y and each row's mean and 1/std; backward writes dx
// and, per warp, partial column sums for dweight and dbias, which a plain
// column reduction then adds up (no atomics: the same sums every run).
#include "tensor/cuda/kernel_utils.cuh"
#include "tensor/cuda/layer_norm.h"

namespace mpt::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;

template <typename T, int kCols>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    layer_norm_forward_kernel(T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                              const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                              int64_t rows, int d, float eps) {
  using E = Element<T>;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; row < rows;
       row += warps) {
    const T* xr = x + row * d;
    float v[kCols];
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kCols; ++i) {
      const int c = lane + 32 * i;
      v[i] = c < d ? E::load(xr[c]) : 0.0f;
      sum += v[i];
    }
    const float mean = warp_sum(sum) / d;
    float sq = 0.0f;
#pragma unroll
    for (int i = 0; i < kCols; ++i) {
      const int c = lane + 32 * i;
      const float dev = c < d ? v[i] - mean : 0.0f;
      sq += dev * dev;
    }
    const float rstd = 1.0f / sqrtf(warp_sum(sq) / d + eps);
    T* yr = y + row * d;
#pragma unroll
    for (int i = 0; i < kCols; ++i) {
      const int c = lane + 32 * i;
      if (c >= d) continue;
      float out = (v[i] - mean) * rstd;
      if (w) out *= E::load(w[c]);
      if (b) out += E::load(b[c]);
      yr[c] = E::store(out);
    }
    if (lane == 0) {
      mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
  }
}

// partial_w/partial_b: [total warps, d] f32, this warp's sums over its rows.
template <typename T, int kCols>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    layer_norm_backward_kernel(T* __restrict__ dx, float* __restrict__ partial_w, float* __restrict__ partial_b,
                               const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                               const float* __restrict__ mean_in, const float* __restrict__ rstd_in, int64_t rows,
                               int d) {
  using E = Element<T>;
  const int lane = threadIdx.x % 32;
  const int64_t warp_id = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  float acc_w[kCols], acc_b[kCols];
#pragma unroll
  for (int i = 0; i < kCols; ++i) acc_w[i] = acc_b[i] = 0.0f;
  for (int64_t row = warp_id; row < rows; row += warps) {
    const float mean = mean_in[row], rstd = rstd_in[row];
    float xhat[kCols], g[kCols];
    float sum_g = 0.0f, sum_gx = 0.0f;
#pragma unroll
    for (int i = 0; i < kCols; ++i) {
      const int c = lane + 32 * i;
      if (c < d) {
        const float gy = E::load(dy[row * d + c]);
        xhat[i] = (E::load(x[row * d + c]) - mean) * rstd;
        g[i] = w ? gy * E::load(w[c]) : gy;
        acc_w[i] += gy * xhat[i];
        acc_b[i] += gy;
      } else {
        xhat[i] = g[i] = 0.0f;
      }
      sum_g += g[i];
      sum_gx += g[i] * xhat[i];
    }
    const float mean_g = warp_sum(sum_g) / d, mean_gx = warp_sum(sum_gx) / d;
#pragma unroll
    for (int i = 0; i < kCols; ++i) {
      const int c = lane + 32 * i;
      if (c < d) dx[row * d + c] = E::store(rstd * (g[i] - mean_g - xhat[i] * mean_gx));
    }
  }
#pragma unroll
  for (int i = 0; i < kCols; ++i) {
    const int c = lane + 32 * i;
    if (c < d) {
      partial_w[warp_id * d + c] = acc_w[i];
      partial_b[warp_id * d + c] = acc_b[i];
    }
  }
}

template <typename F>
void dispatch(DType dtype, int d, const char* op, F&& f) {
  auto by_cols = [&](auto tag) {
    using T = decltype(tag);
    if (d <= 128) return f.template operator()<T, 4>();
    if (d <= 256) return f.template operator()<T, 8>();
    if (d <= 512) return f.template operator()<T, 16>();
    return f.template operator()<T, 32>();
  };
  dispatch_floating<false>(dtype, op, by_cols);
}

unsigned blocks_for(const Launch& l, int64_t rows) {
  const int64_t want = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(want, 4 * l.sm_count)));
}

}  // namespace

bool fused_layer_norm_supported(DType dtype, int64_t d) {
  return (dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16) && d >= 1 && d <= kMaxFusedLayerNorm;
}

void launch_layer_norm_forward(const Launch& l, const LayerNormArgs& a, void* y) {
  if (a.rows == 0) return;
  dispatch(a.dtype, a.d, "layer_norm", [&]<typename T, int kCols>() {
    layer_norm_forward_kernel<T, kCols><<<blocks_for(l, a.rows), kWarpsPerBlock * 32, 0, l.stream>>>(
        static_cast<T*>(y), a.mean, a.rstd, static_cast<const T*>(a.x), static_cast<const T*>(a.weight),
        static_cast<const T*>(a.bias), a.rows, a.d, a.eps);
  });
  MPT_CUDA_CHECK_LAUNCH("layer_norm_forward_kernel");
}

int64_t layer_norm_backward_partials(const Launch& l, int64_t rows) {
  return static_cast<int64_t>(blocks_for(l, rows)) * kWarpsPerBlock;
}

void launch_layer_norm_backward(const Launch& l, const LayerNormArgs& a, const void* dy, void* dx, float* partial_w,
                                float* partial_b) {
  if (a.rows == 0) return;
  dispatch(a.dtype, a.d, "layer_norm backward", [&]<typename T, int kCols>() {
    layer_norm_backward_kernel<T, kCols><<<blocks_for(l, a.rows), kWarpsPerBlock * 32, 0, l.stream>>>(
        static_cast<T*>(dx), partial_w, partial_b, static_cast<const T*>(dy), static_cast<const T*>(a.x),
        static_cast<const T*>(a.weight), a.mean, a.rstd, a.rows, a.d);
  });
  MPT_CUDA_CHECK_LAUNCH("layer_norm_backward_kernel");
}

}  // namespace mpt::cuda
