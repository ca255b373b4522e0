// Multi-tensor AdamW and SGD. The tensor list travels in the kernel's
// parameter block (no device copy of metadata, so a launch is capturable in a
// CUDA graph): each launch carries up to kMaxTensors tensors and kMaxBlocks
// chunks (tensor/cuda/multi_tensor.cuh); each block updates one chunk of
// one tensor. Longer lists take several launches.
#include "models/fused_optim.h"

#include "tensor/cuda/fp8_codes.cuh"
#include "tensor/cuda/kernel_utils.cuh"
#include "tensor/cuda/multi_tensor.cuh"
#include "tensor/cuda/runtime.h"

namespace mpt::optim::fused {
namespace {

constexpr int kMaxTensors = 36;
constexpr int kMaxBlocks = 320;
constexpr int kThreads = 512;

template <typename Tensor>
struct TensorList {
  Tensor tensors[kMaxTensors];
  cuda::BlockTable<kMaxBlocks> blocks;
};
// The classic 4 KiB kernel parameter limit, so any driver takes it.
static_assert(sizeof(TensorList<AdamWTensor>) + sizeof(AdamWScalars) <= 4000);
static_assert(sizeof(TensorList<SGDTensor>) + sizeof(SGDScalars) <= 4000);

// Element i of a type-erased operand, converted as Element<T> converts.
template <typename T>
__device__ __forceinline__ float load(const void* p, int64_t i) {
  return cuda::Element<T>::load(static_cast<const T*>(p)[i]);
}
template <typename T>
__device__ __forceinline__ void store(void* p, int64_t i, float v) {
  static_cast<T*>(p)[i] = cuda::Element<T>::store(v);
}

// An update's per-tensor factors: from the host, or (device-step mode)
// from the parameter's count on the device and the group's hyper-parameters.
struct AdamWFactors {
  float step_size, inv_bc2_sqrt, decay;
};

__device__ __forceinline__ AdamWFactors adamw_factors(const AdamWTensor& t, const AdamWScalars& s) {
  AdamWFactors f{t.step_size, t.inv_bc2_sqrt, s.decay};
  if (t.step) {
    // Bias corrections in double, as the host computes them, from this update's t.
    const double step = *t.step + 1.0;
    const float lr = s.hyper[kLr];
    f.decay = s.hyper[kDecay];
    f.step_size = static_cast<float>(lr / (1.0 - pow(s.correction_beta1, step)));
    f.inv_bc2_sqrt = static_cast<float>(1.0 / sqrt(1.0 - pow(s.correction_beta2, step)));
  }
  return f;
}

// One element's update, every rounding spelled out (fma.rn and mul.rn are
// never contracted): the compiler cannot fuse the update's multiplies and
// adds differently from one build to the next, so its bits do not depend
// on what compiled it (tests/test_fused_optim.cpp holds the same rule on
// the host, and models/fused_optim_host.cpp computes it there).
__device__ __forceinline__ float adamw_update(const AdamWScalars& s, const AdamWFactors& f, float p, float g, float& m,
                                              float& v) {
  m = __fmaf_rn(s.beta1, m, __fmul_rn(s.one_minus_beta1, g));
  v = __fmaf_rn(s.beta2, v, __fmul_rn(__fmul_rn(s.one_minus_beta2, g), g));
  const float denom = __fmaf_rn(__fsqrt_rn(v), f.inv_bc2_sqrt, s.eps);
  return __fmaf_rn(p, f.decay, -__fdiv_rn(__fmul_rn(f.step_size, m), denom));
}

template <typename T>
__global__ void __launch_bounds__(kThreads) adamw_kernel(TensorList<AdamWTensor> list, AdamWScalars s) {
  if (s.found_inf && *s.found_inf != 0.0f) return;  // the loss scaler skips this step
  const cuda::BlockChunk c = cuda::this_block_chunk(list.blocks, [&](int slot) { return list.tensors[slot].numel; });
  const AdamWTensor& t = list.tensors[c.slot];
  const AdamWFactors f = adamw_factors(t, s);
  const int64_t begin = c.begin, end = c.begin + c.count;
  auto update = [&](float p, float g, float& m, float& v) { return adamw_update(s, f, p, g, m, v); };
  // 16-byte packs of all four operands when they allow it (they start
  // aligned from the caching allocator, and chunks are whole packs): four
  // streams of wide loads keep more bytes in flight than element loads.
  constexpr int V = 16 / sizeof(T);
  using P = cuda::Pack<T, V>;
  int64_t i = begin;
  const uintptr_t addresses = reinterpret_cast<uintptr_t>(t.param) | reinterpret_cast<uintptr_t>(t.grad) |
                              reinterpret_cast<uintptr_t>(t.exp_avg) | reinterpret_cast<uintptr_t>(t.exp_avg_sq);
  if (addresses % 16 == 0) {
    const int64_t packs_end = begin + (end - begin) / V * V;
    for (int64_t j = begin + static_cast<int64_t>(threadIdx.x) * V; j < packs_end; j += static_cast<int64_t>(kThreads) * V) {
      P p = *reinterpret_cast<const P*>(static_cast<const T*>(t.param) + j);
      const P g = *reinterpret_cast<const P*>(static_cast<const T*>(t.grad) + j);
      P m = *reinterpret_cast<const P*>(static_cast<const T*>(t.exp_avg) + j);
      P v = *reinterpret_cast<const P*>(static_cast<const T*>(t.exp_avg_sq) + j);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        float mf = cuda::Element<T>::load(m.v[e]), vf = cuda::Element<T>::load(v.v[e]);
        const float pf = update(cuda::Element<T>::load(p.v[e]), cuda::Element<T>::load(g.v[e]), mf, vf);
        p.v[e] = cuda::Element<T>::store(pf);
        m.v[e] = cuda::Element<T>::store(mf);
        v.v[e] = cuda::Element<T>::store(vf);
      }
      *reinterpret_cast<P*>(static_cast<T*>(t.param) + j) = p;
      *reinterpret_cast<P*>(static_cast<T*>(t.exp_avg) + j) = m;
      *reinterpret_cast<P*>(static_cast<T*>(t.exp_avg_sq) + j) = v;
    }
    i = packs_end;
  }
  for (i += threadIdx.x; i < end; i += kThreads) {
    float m = load<T>(t.exp_avg, i), v = load<T>(t.exp_avg_sq, i);
    const float p = update(load<T>(t.param, i), load<T>(t.grad, i), m, v);
    store<T>(t.exp_avg, i, m);
    store<T>(t.exp_avg_sq, i, v);
    store<T>(t.param, i, p);
  }
}

// adamw_quantized: one f32 weight [rows, cols] in 64 x 64 tiles, a block a
// tile, as fp8_quantize.cu's quantize_tiles lays them out: each thread
// updates 16 consecutive elements of a row, stores their codes with one
// 16-byte store, and after the tile's codes are in shared memory gathers
// 16 codes of a column for the transpose.
constexpr int kCopyTile = cuda::kFp8Tile, kCopyChunk = cuda::kFp8Chunk;
constexpr int kCopyThreads = kCopyTile * kCopyTile / kCopyChunk;
static_assert(kCopyThreads == cuda::kThreads, "block_amax sizes its shared memory for cuda::kThreads");

__global__ void __launch_bounds__(kCopyThreads)
    adamw_quantized_kernel(AdamWTensor t, QuantizedCopyTarget q, AdamWScalars s) {
  __shared__ alignas(16) cuda::Fp8TileCodes tile;
  const bool skip = s.found_inf && *s.found_inf != 0.0f;  // the copies are made all the same
  const AdamWFactors f = adamw_factors(t, s);
  const float scale = *q.scale;
  const __nv_fp8_interpretation_t format = q.e5m2 ? __NV_E5M2 : __NV_E4M3;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kCopyTile, col0 = static_cast<int64_t>(blockIdx.x) * kCopyTile;
  const int r = threadIdx.x / (kCopyTile / kCopyChunk), c = (threadIdx.x % (kCopyTile / kCopyChunk)) * kCopyChunk;
  uint32_t bits = 0;
  if (row0 + r < q.rows && col0 + c < q.cols) {
    using P = cuda::Pack<float, 4>;
    constexpr int kPacks = kCopyChunk / 4;
    const int64_t at = (row0 + r) * q.cols + col0 + c;
    auto* param = reinterpret_cast<P*>(static_cast<float*>(t.param) + at);
    const auto* grad = reinterpret_cast<const P*>(static_cast<const float*>(t.grad) + at);
    auto* exp_avg = reinterpret_cast<P*>(static_cast<float*>(t.exp_avg) + at);
    auto* exp_avg_sq = reinterpret_cast<P*>(static_cast<float*>(t.exp_avg_sq) + at);
    P p[kPacks], g[kPacks], m[kPacks], v[kPacks];
#pragma unroll
    for (int k = 0; k < kPacks; ++k) p[k] = param[k];
    if (!skip) {
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        g[k] = grad[k];
        m[k] = exp_avg[k];
        v[k] = exp_avg_sq[k];
      }
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
#pragma unroll
        for (int e = 0; e < 4; ++e) p[k].v[e] = adamw_update(s, f, p[k].v[e], g[k].v[e], m[k].v[e], v[k].v[e]);
        param[k] = p[k];
        exp_avg[k] = m[k];
        exp_avg_sq[k] = v[k];
      }
    }
    cuda::Pack<uint8_t, kCopyChunk> codes;
#pragma unroll
    for (int i = 0; i < kCopyChunk; ++i) {
      const float w = p[i / 4].v[i % 4];
      bits = max(bits, cuda::abs_bits(w));
      codes.v[i] = cuda::to_fp8(w * scale, format);
    }
    *reinterpret_cast<cuda::Pack<uint8_t, kCopyChunk>*>(static_cast<uint8_t*>(q.data) + at) = codes;
    cuda::store_tile_chunk(tile, r, c, *reinterpret_cast<const uint4*>(&codes));
  }
  __syncthreads();
  cuda::store_transposed_chunk(tile, r, c, row0, col0, q.rows, q.cols, static_cast<uint8_t*>(q.data_t));
  cuda::block_amax(bits, q.amax);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *q.scale_inv = 1.0f / scale;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) sgd_kernel(TensorList<SGDTensor> list, SGDScalars s) {
  if (s.found_inf && *s.found_inf != 0.0f) return;  // the loss scaler skips this step
  const cuda::BlockChunk c = cuda::this_block_chunk(list.blocks, [&](int slot) { return list.tensors[slot].numel; });
  const SGDTensor& t = list.tensors[c.slot];
  float lr = s.lr, weight_decay = s.weight_decay;
  bool first = t.first;
  if (t.step) {
    lr = s.hyper[kLr];
    weight_decay = s.hyper[kWeightDecay];
    first = first || *t.step == 0.0f;
  }
  const int64_t end = c.begin + c.count;
  // Roundings spelled out as in AdamW (models/fused_optim_host.cpp does the same).
  for (int64_t i = c.begin + threadIdx.x; i < end; i += kThreads) {
    const float p = load<T>(t.param, i);
    float d = __fmaf_rn(weight_decay, p, load<T>(t.grad, i));
    if (t.momentum_buffer) {
      const float buf =
          first ? d : __fmaf_rn(s.momentum, load<T>(t.momentum_buffer, i), __fmul_rn(s.one_minus_dampening, d));
      store<T>(t.momentum_buffer, i, buf);
      d = s.nesterov ? __fmaf_rn(s.momentum, buf, d) : buf;
    }
    store<T>(t.param, i, __fmaf_rn(-lr, d, p));
  }
}

constexpr int kMaxSteps = 400;  // step counters per launch (3.2 KB of pointers)
struct StepList {
  float* steps[kMaxSteps];
  int count;
};

__global__ void advance_steps_kernel(StepList list, const float* found_inf) {
  if (found_inf && *found_inf != 0.0f) return;
  for (int i = threadIdx.x; i < list.count; i += blockDim.x) *list.steps[i] += 1.0f;
}

// Packs `tensors` into as few lists as the limits allow and launches each.
template <typename Tensor, typename Launch>
void for_each_list(const std::vector<Tensor>& tensors, Launch&& launch) {
  TensorList<Tensor> list{};
  std::vector<int64_t> sizes;
  for (const Tensor& t : tensors) sizes.push_back(t.numel);
  list.blocks.chunk = cuda::chunk_for(sizes.data(), sizes.size(), cuda::multiprocessor_count(cuda::current_device()));
  cuda::plan_chunked_launches(
      list.blocks, sizes.data(), sizes.size(), kMaxTensors,
      [&](int slot, size_t i) { list.tensors[slot] = tensors[i]; }, [&](int blocks) { launch(list, blocks); });
}

}  // namespace

bool available() { return true; }

void adamw(DType dtype, const std::vector<AdamWTensor>& tensors, const AdamWScalars& s) {
  const cudaStream_t stream = cuda::current_cuda_stream();
  cuda::dispatch_floating<false>(dtype, "fused AdamW", [&](auto tag) {
    using T = decltype(tag);
    for_each_list(tensors, [&](const TensorList<AdamWTensor>& list, int blocks) {
      adamw_kernel<T><<<blocks, kThreads, 0, stream>>>(list, s);
      MPT_CUDA_CHECK_LAUNCH("adamw_kernel");
    });
  });
}

void adamw_quantized(const AdamWTensor& tensor, const QuantizedCopyTarget& copy, const AdamWScalars& s) {
  // The caller checked the sizes and alignments (models/adamw.cpp).
  if (tensor.numel == 0) return;
  const dim3 grid(static_cast<unsigned>((copy.cols + kCopyTile - 1) / kCopyTile),
                  static_cast<unsigned>((copy.rows + kCopyTile - 1) / kCopyTile));
  adamw_quantized_kernel<<<grid, kCopyThreads, 0, cuda::current_cuda_stream()>>>(tensor, copy, s);
  MPT_CUDA_CHECK_LAUNCH("adamw_quantized_kernel");
}

void advance_steps(const std::vector<float*>& steps, const float* found_inf) {
  const cudaStream_t stream = cuda::current_cuda_stream();
  for (size_t first = 0; first < steps.size(); first += kMaxSteps) {
    StepList list{};
    list.count = static_cast<int>(std::min<size_t>(kMaxSteps, steps.size() - first));
    for (int i = 0; i < list.count; ++i) list.steps[i] = steps[first + i];
    advance_steps_kernel<<<1, 128, 0, stream>>>(list, found_inf);
    MPT_CUDA_CHECK_LAUNCH("advance_steps_kernel");
  }
}

void sgd(DType dtype, const std::vector<SGDTensor>& tensors, const SGDScalars& s) {
  const cudaStream_t stream = cuda::current_cuda_stream();
  cuda::dispatch_floating<false>(dtype, "fused SGD", [&](auto tag) {
    using T = decltype(tag);
    for_each_list(tensors, [&](const TensorList<SGDTensor>& list, int blocks) {
      sgd_kernel<T><<<blocks, kThreads, 0, stream>>>(list, s);
      MPT_CUDA_CHECK_LAUNCH("sgd_kernel");
    });
  });
}

}  // namespace mpt::optim::fused
