// Multi-tensor AdamW and SGD. The tensor list travels in the kernel's
// parameter block (no device copy of metadata, so a launch is capturable in a
// CUDA graph): each launch carries up to kMaxTensors tensors and kMaxBlocks
// chunks of kChunk elements; block b updates chunk block_chunk[b] of tensor
// block_tensor[b]. Longer lists take several launches.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "models/fused_optim.h"
#include "tensor/cuda/check.h"
#include "tensor/cuda/kernels.h"
#include "tensor/cuda/runtime.h"

namespace mpt::optim::fused {
namespace {

constexpr int kMaxTensors = 36;
constexpr int kMaxBlocks = 320;
constexpr int64_t kChunk = 65536;
constexpr int kThreads = 512;

template <typename Tensor>
struct TensorList {
  Tensor tensors[kMaxTensors];
  uint8_t block_tensor[kMaxBlocks];
  int32_t block_chunk[kMaxBlocks];
};
// The classic 4 KiB kernel parameter limit, so any driver takes it.
static_assert(sizeof(TensorList<AdamWTensor>) + sizeof(AdamWScalars) <= 4000);

template <typename T>
struct Scalar;
template <>
struct Scalar<float> {
  static __device__ __forceinline__ float load(const void* p, int64_t i) { return static_cast<const float*>(p)[i]; }
  static __device__ __forceinline__ void store(void* p, int64_t i, float v) { static_cast<float*>(p)[i] = v; }
};
template <>
struct Scalar<__half> {
  static __device__ __forceinline__ float load(const void* p, int64_t i) {
    return __half2float(static_cast<const __half*>(p)[i]);
  }
  static __device__ __forceinline__ void store(void* p, int64_t i, float v) {
    static_cast<__half*>(p)[i] = __float2half_rn(v);
  }
};
template <>
struct Scalar<__nv_bfloat16> {
  static __device__ __forceinline__ float load(const void* p, int64_t i) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  }
  static __device__ __forceinline__ void store(void* p, int64_t i, float v) {
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
  }
};

template <typename T>
__global__ void __launch_bounds__(kThreads) adamw_kernel(TensorList<AdamWTensor> list, AdamWScalars s) {
  const AdamWTensor& t = list.tensors[list.block_tensor[blockIdx.x]];
  const int64_t begin = static_cast<int64_t>(list.block_chunk[blockIdx.x]) * kChunk;
  const int64_t end = min(begin + kChunk, t.numel);
  using E = Scalar<T>;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const float g = E::load(t.grad, i);
    const float m = s.beta1 * E::load(t.exp_avg, i) + (1.0f - s.beta1) * g;
    const float v = s.beta2 * E::load(t.exp_avg_sq, i) + (1.0f - s.beta2) * g * g;
    const float denom = sqrtf(v) * t.inv_bc2_sqrt + s.eps;
    const float p = E::load(t.param, i) * s.decay - t.step_size * m / denom;
    E::store(t.exp_avg, i, m);
    E::store(t.exp_avg_sq, i, v);
    E::store(t.param, i, p);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) sgd_kernel(TensorList<SGDTensor> list, SGDScalars s) {
  const SGDTensor& t = list.tensors[list.block_tensor[blockIdx.x]];
  const int64_t begin = static_cast<int64_t>(list.block_chunk[blockIdx.x]) * kChunk;
  const int64_t end = min(begin + kChunk, t.numel);
  using E = Scalar<T>;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const float p = E::load(t.param, i);
    float d = E::load(t.grad, i) + s.weight_decay * p;
    if (t.momentum_buffer) {
      const float buf = t.first ? d : s.momentum * E::load(t.momentum_buffer, i) + (1.0f - s.dampening) * d;
      E::store(t.momentum_buffer, i, buf);
      d = s.nesterov ? d + s.momentum * buf : buf;
    }
    E::store(t.param, i, p - s.lr * d);
  }
}

// Packs `tensors` into as few lists as the limits allow and launches each.
template <typename Tensor, typename Launch>
void for_each_list(const std::vector<Tensor>& tensors, Launch&& launch) {
  TensorList<Tensor> list{};
  int n_tensors = 0, n_blocks = 0;
  auto flush = [&] {
    if (n_blocks > 0) launch(list, n_blocks);
    n_tensors = 0;
    n_blocks = 0;
  };
  for (const Tensor& t : tensors) {
    if (t.numel == 0) continue;
    const int64_t chunks = (t.numel + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      if (n_blocks == kMaxBlocks || (c == 0 && n_tensors == kMaxTensors)) flush();
      if (c == 0 || n_blocks == 0) list.tensors[n_tensors++] = t;  // a tensor may continue in the next list
      list.block_tensor[n_blocks] = static_cast<uint8_t>(n_tensors - 1);
      list.block_chunk[n_blocks] = static_cast<int32_t>(c);
      ++n_blocks;
    }
  }
  flush();
}

template <typename F>
void dispatch(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::f32: return f(float{});
    case DType::f16: return f(__half{});
    case DType::bf16: return f(__nv_bfloat16{});
    default: cuda::throw_dtype_unsupported(op, dtype);
  }
}

}  // namespace

bool available() { return true; }

void adamw(DType dtype, const std::vector<AdamWTensor>& tensors, const AdamWScalars& s) {
  const cudaStream_t stream = cuda::current_cuda_stream();
  dispatch(dtype, "fused AdamW", [&](auto tag) {
    using T = decltype(tag);
    for_each_list(tensors, [&](const TensorList<AdamWTensor>& list, int blocks) {
      adamw_kernel<T><<<blocks, kThreads, 0, stream>>>(list, s);
      MPT_CUDA_CHECK_LAUNCH("adamw_kernel");
    });
  });
}

void sgd(DType dtype, const std::vector<SGDTensor>& tensors, const SGDScalars& s) {
  const cudaStream_t stream = cuda::current_cuda_stream();
  dispatch(dtype, "fused SGD", [&](auto tag) {
    using T = decltype(tag);
    for_each_list(tensors, [&](const TensorList<SGDTensor>& list, int blocks) {
      sgd_kernel<T><<<blocks, kThreads, 0, stream>>>(list, s);
      MPT_CUDA_CHECK_LAUNCH("sgd_kernel");
    });
  });
}

}  // namespace mpt::optim::fused
