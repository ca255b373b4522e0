// The fused optimizers' rules as loops on the host, the CPU's fused path:
// one pass over each parameter instead of a dozen raw-op passes with their
// temporaries. Every rounding is the CUDA kernels' (std::fma where they
// fuse, and this file is built without floating-point contraction), so the
// CPU and the GPU update the same values to the same bits. A large tensor
// is split over the CPU backend's threads (each element's update is its
// own, so the split changes no bits).
#include <cmath>

#include "models/fused_optim.h"
#include "tensor/error.h"
#include "tensor/half.h"
#include "tensor/host_parallel.h"

namespace mpt::optim::fused {
namespace {

// The operands as unaliased local pointers and values: so the compiler
// vectorizes the loop (a store through a float pointer could otherwise
// change the tensor's own float fields, which it would then reload).
// Elements [begin, end).
template <typename T>
void adamw_run(const AdamWTensor& t, const AdamWScalars& s, int64_t begin, int64_t end) {
  T* __restrict param = static_cast<T*>(t.param);
  const T* __restrict grad = static_cast<const T*>(t.grad);
  T* __restrict exp_avg = static_cast<T*>(t.exp_avg);
  T* __restrict exp_avg_sq = static_cast<T*>(t.exp_avg_sq);
  const float b1 = s.beta1, b2 = s.beta2, one_minus_b1 = s.one_minus_beta1, one_minus_b2 = s.one_minus_beta2;
  const float eps = s.eps, decay = s.decay, step_size = t.step_size, inv_bc2_sqrt = t.inv_bc2_sqrt;
  for (int64_t i = begin; i < end; ++i) {
    const float g = static_cast<float>(grad[i]);
    const float m = std::fma(b1, static_cast<float>(exp_avg[i]), one_minus_b1 * g);
    const float v = std::fma(b2, static_cast<float>(exp_avg_sq[i]), (one_minus_b2 * g) * g);
    const float denom = std::fma(std::sqrt(v), inv_bc2_sqrt, eps);
    param[i] = T(std::fma(static_cast<float>(param[i]), decay, -((step_size * m) / denom)));
    exp_avg[i] = T(m);
    exp_avg_sq[i] = T(v);
  }
}

template <typename T>
void sgd_run(const SGDTensor& t, const SGDScalars& s, int64_t begin, int64_t end) {
  T* __restrict param = static_cast<T*>(t.param);
  const T* __restrict grad = static_cast<const T*>(t.grad);
  T* __restrict buffer = static_cast<T*>(t.momentum_buffer);
  const float lr = s.lr, weight_decay = s.weight_decay, momentum = s.momentum;
  const float one_minus_dampening = s.one_minus_dampening;
  const bool first = t.first, nesterov = s.nesterov;
  for (int64_t i = begin; i < end; ++i) {
    const float p = static_cast<float>(param[i]);
    float d = std::fma(weight_decay, p, static_cast<float>(grad[i]));
    if (buffer) {
      const float buf = first ? d : std::fma(momentum, static_cast<float>(buffer[i]), one_minus_dampening * d);
      buffer[i] = T(buf);
      d = nesterov ? std::fma(momentum, buf, d) : buf;
    }
    param[i] = T(std::fma(-lr, d, p));
  }
}

// Runs `run<T>` over every tensor's elements, for the float types the
// kernels take.
template <typename Tensor, typename Scalars, typename Run>
void for_each_tensor(DType dtype, const char* rule, const std::vector<Tensor>& tensors, const Scalars& s, Run&& run) {
  // Device-side counts, rates and skip flags belong to capturable mode,
  // which needs a CUDA device.
  check(s.found_inf == nullptr && s.hyper == nullptr, "{} on the host: device-side scalars are not supported", rule);
  for (const Tensor& t : tensors) {
    check(t.step == nullptr, "{} on the host: device-side step counts are not supported", rule);
    auto split = [&](auto tag) {
      parallel_for_host_elements(t.numel, [&](int64_t begin, int64_t end) { run(tag, t, begin, end); });
    };
    switch (dtype) {
      case DType::f32: split(float{}); break;
      case DType::f16: split(Half{}); break;
      case DType::bf16: split(BFloat16{}); break;
      default: throw DTypeError(fmt::format("{} on the host: dtype {} is not supported", rule, dtype_name(dtype)));
    }
  }
}

}  // namespace

void adamw_on_host(DType dtype, const std::vector<AdamWTensor>& tensors, const AdamWScalars& s) {
  for_each_tensor(dtype, "fused AdamW", tensors, s, [&](auto tag, const AdamWTensor& t, int64_t begin, int64_t end) {
    adamw_run<decltype(tag)>(t, s, begin, end);
  });
}

void sgd_on_host(DType dtype, const std::vector<SGDTensor>& tensors, const SGDScalars& s) {
  for_each_tensor(dtype, "fused SGD", tensors, s, [&](auto tag, const SGDTensor& t, int64_t begin, int64_t end) {
    sgd_run<decltype(tag)>(t, s, begin, end);
  });
}

}  // namespace mpt::optim::fused
