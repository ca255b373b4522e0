// Fused softmax cross-entropy over rows of logits: one warp per row, f32
// math, 16-byte loads and stores where every row starts aligned. Forward
// reads each row once (an online softmax: each lane keeps its running
// maximum and its sum of exponentials scaled to it, and the lanes merge at
// the end) and writes each row's loss (0 where the target is ignored), its
// log-sum-exp and whether it counts; backward writes
// (softmax - onehot) * row_scale, rebuilding softmax from the saved
// log-sum-exp. At GPT-2's vocabulary the logits are the largest tensor of
// the step, so each pass over them costs what its bytes cost: one read
// forward, one read and one write backward, and no per-element division.
#include "tensor/cuda/cross_entropy.h"
#include "tensor/cuda/kernel_utils.cuh"

namespace mpt::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;

// Raises a running maximum m to `new_max`, rescaling the running sum of
// exp(value - m) to match.
__device__ __forceinline__ void raise_max(float& m, float& s, float new_max) {
  if (new_max > m) {
    s *= expf(m - new_max);  // 0 while m is still -inf
    m = new_max;
  }
}

template <typename T, int V>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    cross_entropy_forward_kernel(float* __restrict__ loss, float* __restrict__ lse_out, float* __restrict__ valid,
                                 const T* __restrict__ logits, const int64_t* __restrict__ target, int64_t rows,
                                 int64_t classes, int64_t ignore_index) {
  using E = Element<T>;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  const int64_t packs = classes / V;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; row < rows;
       row += warps) {
    const T* x = logits + row * classes;
    float m = -INFINITY, s = 0.0f;
#pragma unroll 4
    for (int64_t p = lane; p < packs; p += 32) {
      const Pack<T, V> in = reinterpret_cast<const Pack<T, V>*>(x)[p];
      float v[V];
      float block_max = -INFINITY;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        v[k] = E::load(in.v[k]);
        block_max = fmaxf(block_max, v[k]);
      }
      raise_max(m, s, block_max);
      // A NaN anywhere makes the sum NaN, and with it the loss: what a loss
      // scaler looks for. A -inf adds nothing, even while m is still -inf
      // (where -inf - -inf would be NaN).
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float e = expf(v[k] - m);
        s += v[k] == -INFINITY ? 0.0f : e;
      }
    }
    const float row_max = warp_max(m);
    // A lane that saw only -inf (or nothing) adds nothing; one that saw
    // only NaN and -inf has a NaN sum, which must reach the loss (NaN * 0).
    s = m == -INFINITY ? s * 0.0f : s * expf(m - row_max);
    s = warp_sum(s);
    if (lane == 0) {
      const float lse = row_max + logf(s);
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

template <typename T, int V>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    cross_entropy_backward_kernel(T* __restrict__ grad, const T* __restrict__ logits,
                                  const int64_t* __restrict__ target, const float* __restrict__ lse,
                                  const float* __restrict__ row_scale, int64_t rows, int64_t classes) {
  using E = Element<T>;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  const int64_t packs = classes / V;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; row < rows;
       row += warps) {
    const auto* x = reinterpret_cast<const Pack<T, V>*>(logits + row * classes);
    auto* g = reinterpret_cast<Pack<T, V>*>(grad + row * classes);
    const float row_lse = lse[row], scale = row_scale[row];
    const int64_t t = target[row];
#pragma unroll 4
    for (int64_t p = lane; p < packs; p += 32) {
      const Pack<T, V> in = x[p];
      Pack<T, V> out;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float softmax = expf(E::load(in.v[k]) - row_lse);
        out.v[k] = E::store((softmax - (p * V + k == t ? 1.0f : 0.0f)) * scale);
      }
      g[p] = out;
    }
  }
}

// Calls f.template operator()<T, V>(): V elements a load where every row
// of the logits and the gradient starts 16-byte aligned, else one.
template <typename F>
void dispatch_row_packs(DType dtype, const char* op, int64_t classes, std::initializer_list<const void*> ptrs,
                        F&& f) {
  dispatch_floating<false>(dtype, op, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    if (classes % V == 0 && aligned_to(16, ptrs))
      f.template operator()<T, V>();
    else
      f.template operator()<T, 1>();
  });
}

unsigned row_blocks(const Launch& l, int64_t rows) {
  const int64_t want = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(want, 8 * l.sm_count)));
}

}  // namespace

bool fused_cross_entropy_supported(DType dtype) {
  return dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16;
}

void launch_cross_entropy_forward(const Launch& l, DType dtype, const CrossEntropyArgs& a, float* loss,
                                  float* valid) {
  if (a.rows == 0) return;
  dispatch_row_packs(dtype, "cross_entropy", a.classes, {a.logits}, [&]<typename T, int V>() {
    cross_entropy_forward_kernel<T, V><<<row_blocks(l, a.rows), kWarpsPerBlock * 32, 0, l.stream>>>(
        loss, a.lse, valid, static_cast<const T*>(a.logits), a.target, a.rows, a.classes, a.ignore_index);
  });
  MPT_CUDA_CHECK_LAUNCH("cross_entropy_forward_kernel");
}

void launch_cross_entropy_backward(const Launch& l, DType dtype, const CrossEntropyArgs& a, const float* row_scale,
                                   void* grad) {
  if (a.rows == 0) return;
  dispatch_row_packs(dtype, "cross_entropy backward", a.classes, {a.logits, grad}, [&]<typename T, int V>() {
    cross_entropy_backward_kernel<T, V><<<row_blocks(l, a.rows), kWarpsPerBlock * 32, 0, l.stream>>>(
        static_cast<T*>(grad), static_cast<const T*>(a.logits), a.target, a.lse, row_scale, a.rows, a.classes);
  });
  MPT_CUDA_CHECK_LAUNCH("cross_entropy_backward_kernel");
}

}  // namespace mpt::cuda
