// Fused softmax cross-entropy over rows of logits: one warp per row, f32
// math. Forward writes each row's loss (0 where the target is ignored), its
// log-sum-exp and whether it counts; backward writes
// (softmax - onehot) * row_scale in one pass, rebuilding softmax from the
// saved log-sum-exp.
#include "tensor/cuda/cross_entropy.h"
#include "tensor/cuda/kernel_utils.cuh"

namespace mpt::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;

template <typename T>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    cross_entropy_forward_kernel(float* __restrict__ loss, float* __restrict__ lse_out, float* __restrict__ valid,
                                 const T* __restrict__ logits, const int64_t* __restrict__ target, int64_t rows,
                                 int64_t classes, int64_t ignore_index) {
  using E = Element<T>;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; row < rows;
       row += warps) {
    const T* x = logits + row * classes;
    float m = -INFINITY;
    for (int64_t c = lane; c < classes; c += 32) m = fmaxf(m, E::load(x[c]));
    m = warp_max(m);
    float s = 0.0f;
    for (int64_t c = lane; c < classes; c += 32) s += expf(E::load(x[c]) - m);
    s = warp_sum(s);
    if (lane == 0) {
      const float lse = m + logf(s);
      const int64_t t = target[row];
      const bool counts = t != ignore_index;
      lse_out[row] = lse;
      valid[row] = counts ? 1.0f : 0.0f;
      // A target outside [0, classes) was reported by the index check; its
      // loss is NaN rather than a read outside the row.
      loss[row] = !counts ? 0.0f : t >= 0 && t < classes ? lse - E::load(x[t]) : NAN;
    }
  }
}

template <typename T>
__global__ void cross_entropy_backward_kernel(T* __restrict__ grad, const T* __restrict__ logits,
                                              const int64_t* __restrict__ target, const float* __restrict__ lse,
                                              const float* __restrict__ row_scale, int64_t rows, int64_t classes) {
  using E = Element<T>;
  const int64_t total = rows * classes;
  for (int64_t i = global_thread(); i < total; i += grid_threads()) {
    const int64_t row = i / classes, c = i % classes;
    const float p = expf(E::load(logits[i]) - lse[row]);
    grad[i] = E::store((p - (c == target[row] ? 1.0f : 0.0f)) * row_scale[row]);
  }
}

}  // namespace

bool fused_cross_entropy_supported(DType dtype) {
  return dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16;
}

void launch_cross_entropy_forward(const Launch& l, DType dtype, const CrossEntropyArgs& a, float* loss,
                                  float* valid) {
  if (a.rows == 0) return;
  const int64_t want = (a.rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const unsigned blocks = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(want, 4 * l.sm_count)));
  dispatch_floating<false>(dtype, "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    cross_entropy_forward_kernel<T><<<blocks, kWarpsPerBlock * 32, 0, l.stream>>>(
        loss, a.lse, valid, static_cast<const T*>(a.logits), a.target, a.rows, a.classes, a.ignore_index);
  });
  MPT_CUDA_CHECK_LAUNCH("cross_entropy_forward_kernel");
}

void launch_cross_entropy_backward(const Launch& l, DType dtype, const CrossEntropyArgs& a, const float* row_scale,
                                   void* grad) {
  if (a.rows == 0) return;
  dispatch_floating<false>(dtype, "cross_entropy backward", [&](auto tag) {
    using T = decltype(tag);
    cross_entropy_backward_kernel<T><<<grid_for(l, a.rows * a.classes), kThreads, 0, l.stream>>>(
        static_cast<T*>(grad), static_cast<const T*>(a.logits), a.target, a.lse, row_scale, a.rows, a.classes);
  });
  MPT_CUDA_CHECK_LAUNCH("cross_entropy_backward_kernel");
}

}  // namespace mpt::cuda
