// 2-d convolution on CUDA through cuDNN (its convolution API: descriptors,
// an algorithm chosen once per geometry, workspace from the caching
// allocator).
#include "tensor/cuda/conv_cudnn.h"

#include <cudnn.h>

#include <array>
#include <atomic>
#include <map>
#include <mutex>
#include <tuple>

#include <fmt/format.h>

#include "tensor/cuda/caching_allocator.h"
#include "tensor/cuda/check.h"
#include "tensor/cuda/cudnn_handle.h"
#include "tensor/cuda/gemm.h"
#include "tensor/cuda/runtime.h"
#include "tensor/error.h"

namespace mpt::cuda {
namespace {

enum class ConvPass : uint8_t { forward, backward_data, backward_weight };

cudnnDataType_t cudnn_dtype(DType t) {
  switch (t) {
    case DType::f32: return CUDNN_DATA_FLOAT;
    case DType::f64: return CUDNN_DATA_DOUBLE;
    case DType::f16: return CUDNN_DATA_HALF;
    case DType::bf16: return CUDNN_DATA_BFLOAT16;
    default: throw DTypeError(fmt::format("CUDA conv2d: dtype {} is not supported", dtype_name(t)));
  }
}

// The descriptors of one convolution, destroyed together.
struct Descriptors {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  cudnnMathType_t math = CUDNN_DEFAULT_MATH;

  Descriptors(DType dtype, const TensorView& x_view, const TensorView& w_view, const TensorView& y_view,
              const Conv2dParams& p) {
    const cudnnDataType_t t = cudnn_dtype(dtype);
    auto dim = [](const TensorView& v, int i) { return static_cast<int>(v.shape[i]); };
    MPT_CUDNN_CHECK(cudnnCreateTensorDescriptor(&x));
    MPT_CUDNN_CHECK(cudnnCreateTensorDescriptor(&y));
    MPT_CUDNN_CHECK(cudnnCreateFilterDescriptor(&w));
    MPT_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&conv));
    MPT_CUDNN_CHECK(cudnnSetTensor4dDescriptor(x, CUDNN_TENSOR_NCHW, t, dim(x_view, 0), dim(x_view, 1),
                                               dim(x_view, 2), dim(x_view, 3)));
    MPT_CUDNN_CHECK(cudnnSetTensor4dDescriptor(y, CUDNN_TENSOR_NCHW, t, dim(y_view, 0), dim(y_view, 1),
                                               dim(y_view, 2), dim(y_view, 3)));
    MPT_CUDNN_CHECK(cudnnSetFilter4dDescriptor(w, t, CUDNN_TENSOR_NCHW, dim(w_view, 0), dim(w_view, 1),
                                               dim(w_view, 2), dim(w_view, 3)));
    // Half types accumulate in f32, as in the GEMMs.
    const cudnnDataType_t compute = dtype == DType::f64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
    MPT_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(
        conv, static_cast<int>(p.pad_h), static_cast<int>(p.pad_w), static_cast<int>(p.stride_h),
        static_cast<int>(p.stride_w), static_cast<int>(p.dilation_h), static_cast<int>(p.dilation_w),
        CUDNN_CROSS_CORRELATION, compute));
    // f32 stays f32 unless TF32 was allowed, as for matmuls.
    math = dtype == DType::f16 || dtype == DType::bf16 ? CUDNN_TENSOR_OP_MATH
           : dtype == DType::f32 && allow_tf32()       ? CUDNN_DEFAULT_MATH
                                                       : CUDNN_FMA_MATH;
    MPT_CUDNN_CHECK(cudnnSetConvolutionMathType(conv, math));
  }
  ~Descriptors() {
    // Destroy calls only free host memory; their status is of no use here.
    if (conv) (void)cudnnDestroyConvolutionDescriptor(conv);
    if (w) (void)cudnnDestroyFilterDescriptor(w);
    if (y) (void)cudnnDestroyTensorDescriptor(y);
    if (x) (void)cudnnDestroyTensorDescriptor(x);
  }
  Descriptors(const Descriptors&) = delete;
  Descriptors& operator=(const Descriptors&) = delete;
};

std::atomic<bool> g_autotune{false};

// What decides the algorithm: the pass, the device, dtype, shapes, geometry,
// whether TF32 is allowed and whether algorithms are timed.
using PlanKey = std::tuple<ConvPass, int, DType, std::array<int64_t, 12>, std::array<int64_t, 6>, bool, bool>;

struct Plan {
  int algo = 0;  // of the pass's algorithm enum
  size_t workspace = 0;
};

PlanKey make_key(ConvPass pass, int device, DType dtype, const TensorView& x, const TensorView& w,
                 const TensorView& y, const Conv2dParams& p) {
  std::array<int64_t, 12> shapes{};
  for (int i = 0; i < 4; ++i) {
    shapes[i] = x.shape[i];
    shapes[4 + i] = w.shape[i];
    shapes[8 + i] = y.shape[i];
  }
  return {pass, device, dtype, shapes, {p.stride_h, p.stride_w, p.pad_h, p.pad_w, p.dilation_h, p.dilation_w},
          allow_tf32(), g_autotune.load()};
}

constexpr int kWant = 16;  // more than any pass has algorithms

// cuDNN's heuristics: its ranked algorithms, the first one supported for
// these descriptors. No GPU work, so usable while a graph is captured.
template <typename Perf, typename Query>
Plan heuristic(const char* pass_name, Query&& query) {
  std::array<Perf, kWant> perf{};
  int returned = 0;
  MPT_CUDNN_CHECK(query(kWant, &returned, perf.data()));
  for (int i = 0; i < returned; ++i)
    if (perf[i].status == CUDNN_STATUS_SUCCESS) return Plan{static_cast<int>(perf[i].algo), perf[i].memory};
  throw NotAvailableError(fmt::format("CUDA conv2d {}: cuDNN offers no algorithm for this geometry", pass_name));
}

// Times every algorithm on the operands (cuDNN's Find, run once per
// geometry) and keeps the fastest that is deterministic, runs in the math
// mode the descriptor asks for and fits the workspace the timing had: the
// heuristic pick's, or 32 MiB if that is more (bounded, so that timing
// does not raise peak memory much). Bitwise-repeatable runs matter more
// here than the last few percent an atomics-based algorithm might give.
// Falls back to the heuristic pick when nothing qualifies.
template <typename Perf, typename Find>
Plan timed(const Plan& fallback, const Descriptors& d, int device, Find&& find) {
  const size_t budget = std::max<size_t>(fallback.workspace, size_t(32) << 20);
  const CudnnWorkspace ws(device, budget, current_cuda_stream(device));
  std::array<Perf, kWant> perf{};
  int returned = 0;
  MPT_CUDNN_CHECK(find(kWant, &returned, perf.data(), ws.ptr, budget));
  for (int i = 0; i < returned; ++i)  // sorted fastest first
    if (perf[i].status == CUDNN_STATUS_SUCCESS && perf[i].determinism == CUDNN_DETERMINISTIC &&
        perf[i].mathType == d.math && perf[i].memory <= budget)
      return Plan{static_cast<int>(perf[i].algo), perf[i].memory};
  return fallback;
}

bool stream_is_capturing(int device) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  MPT_CUDA_CHECK(cudaStreamIsCapturing(current_cuda_stream(device), &status));
  return status != cudaStreamCaptureStatusNone;
}

Plan find_plan(ConvPass pass, cudnnHandle_t handle, const Descriptors& d, const TensorView& x, const TensorView& w,
               const TensorView& y, const PlanKey& key) {
  static std::mutex mutex;
  static std::map<PlanKey, Plan> plans;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (auto it = plans.find(key); it != plans.end()) return it->second;
  }
  const int device = std::get<1>(key);
  // Timing runs kernels and synchronizes: not while a graph is captured,
  // where the heuristic pick serves this call and a later eager one times.
  const bool time_them = std::get<6>(key) && !stream_is_capturing(device);
  Plan plan;
  switch (pass) {
    case ConvPass::forward:
      plan = heuristic<cudnnConvolutionFwdAlgoPerf_t>("forward", [&](int want, int* got, auto* perf) {
        return cudnnGetConvolutionForwardAlgorithm_v7(handle, d.x, d.w, d.conv, d.y, want, got, perf);
      });
      if (time_them)
        plan = timed<cudnnConvolutionFwdAlgoPerf_t>(plan, d, device, [&](int want, int* got, auto* perf, void* ws,
                                                                          size_t bytes) {
          return cudnnFindConvolutionForwardAlgorithmEx(handle, d.x, x.data, d.w, w.data, d.conv, d.y, y.data, want,
                                                        got, perf, ws, bytes);
        });
      break;
    case ConvPass::backward_data:
      plan = heuristic<cudnnConvolutionBwdDataAlgoPerf_t>("backward data", [&](int want, int* got, auto* perf) {
        return cudnnGetConvolutionBackwardDataAlgorithm_v7(handle, d.w, d.y, d.conv, d.x, want, got, perf);
      });
      if (time_them)
        plan = timed<cudnnConvolutionBwdDataAlgoPerf_t>(plan, d, device, [&](int want, int* got, auto* perf,
                                                                             void* ws, size_t bytes) {
          return cudnnFindConvolutionBackwardDataAlgorithmEx(handle, d.w, w.data, d.y, y.data, d.conv, d.x, x.data,
                                                             want, got, perf, ws, bytes);
        });
      break;
    case ConvPass::backward_weight:
      plan = heuristic<cudnnConvolutionBwdFilterAlgoPerf_t>("backward weight", [&](int want, int* got, auto* perf) {
        return cudnnGetConvolutionBackwardFilterAlgorithm_v7(handle, d.x, d.y, d.conv, d.w, want, got, perf);
      });
      if (time_them)
        plan = timed<cudnnConvolutionBwdFilterAlgoPerf_t>(plan, d, device, [&](int want, int* got, auto* perf,
                                                                               void* ws, size_t bytes) {
          return cudnnFindConvolutionBackwardFilterAlgorithmEx(handle, d.x, x.data, d.y, y.data, d.conv, d.w, w.data,
                                                               want, got, perf, ws, bytes);
        });
      break;
  }
  if (std::get<6>(key) && !time_them) return plan;  // not the timed plan the key stands for
  std::lock_guard<std::mutex> lock(mutex);
  plans.emplace(key, plan);
  return plan;
}

void run(ConvPass pass, const TensorView& x, const TensorView& w, const TensorView& y, const Conv2dParams& p) {
  const int device = current_device();
  const DType dtype = x.dtype;
  const cudnnHandle_t handle = cudnn_handle(device);
  const Descriptors d(dtype, x, w, y, p);
  const Plan plan = find_plan(pass, handle, d, x, w, y, make_key(pass, device, dtype, x, w, y, p));
  const CudnnWorkspace ws(device, plan.workspace, current_cuda_stream(device));
  const float one_f = 1, zero_f = 0;
  const double one_d = 1, zero_d = 0;
  const bool f64 = dtype == DType::f64;
  const void* one = f64 ? static_cast<const void*>(&one_d) : &one_f;
  const void* zero = f64 ? static_cast<const void*>(&zero_d) : &zero_f;
  switch (pass) {
    case ConvPass::forward:
      MPT_CUDNN_CHECK(cudnnConvolutionForward(handle, one, d.x, x.data, d.w, w.data, d.conv,
                                              static_cast<cudnnConvolutionFwdAlgo_t>(plan.algo), ws.ptr,
                                              plan.workspace, zero, d.y, y.data));
      break;
    case ConvPass::backward_data:
      MPT_CUDNN_CHECK(cudnnConvolutionBackwardData(handle, one, d.w, w.data, d.y, y.data, d.conv,
                                                   static_cast<cudnnConvolutionBwdDataAlgo_t>(plan.algo), ws.ptr,
                                                   plan.workspace, zero, d.x, x.data));
      break;
    case ConvPass::backward_weight:
      MPT_CUDNN_CHECK(cudnnConvolutionBackwardFilter(handle, one, d.x, x.data, d.y, y.data, d.conv,
                                                     static_cast<cudnnConvolutionBwdFilterAlgo_t>(plan.algo), ws.ptr,
                                                     plan.workspace, zero, d.w, w.data));
      break;
  }
}

}  // namespace

void set_conv_autotune(bool on) { g_autotune = on; }
bool conv_autotune() { return g_autotune; }

void conv2d_forward(const TensorView& out, const TensorView& x, const TensorView& w, const Conv2dParams& p) {
  run(ConvPass::forward, x, w, out, p);
}

void conv2d_backward_data(const TensorView& grad_x, const TensorView& grad_out, const TensorView& w,
                          const Conv2dParams& p) {
  run(ConvPass::backward_data, grad_x, w, grad_out, p);
}

void conv2d_backward_weight(const TensorView& grad_w, const TensorView& x, const TensorView& grad_out,
                            const Conv2dParams& p) {
  run(ConvPass::backward_weight, x, grad_w, grad_out, p);
}

}  // namespace mpt::cuda
