#pragma once
// Internal: the fused batch norm kernels (tensor/cuda/batch_norm.cu).
#include "tensor/cuda/kernels.h"

namespace mpt::cuda {

// x: contiguous [n, c, s], s the product of the spatial sizes (1 for an
// [N, C] input). The per-channel tensors are f32 [c]; weight and bias may
// be null (absent).
struct BatchNormArgs {
  DType dtype;  // x's, and y's, dy's and dx's
  int64_t n = 0, c = 0, s = 0;
  const void* x = nullptr;
  const float* weight = nullptr;
  const float* bias = nullptr;
  float* mean = nullptr;  // f32 [c]: written forward, read backward
  float* rstd = nullptr;  // f32 [c]: 1 / sqrt(variance + eps)
};

bool fused_batch_norm_supported(DType dtype);
// Bytes of scratch that launch_batch_norm_statistics and
// launch_batch_norm_backward need for a's shape (their per-block partials).
size_t batch_norm_scratch_bytes(const Launch& l, const BatchNormArgs& a);
// Training: the batch's mean and 1/std per channel into a.mean and a.rstd,
// and, where running_mean and running_var are given, the running statistics
// blended in place: r = (1 - momentum) r + momentum * statistic, the
// variance unbiased.
void launch_batch_norm_statistics(const Launch& l, const BatchNormArgs& a, float* running_mean, float* running_var,
                                  double momentum, double eps, void* scratch);
// Evaluation: a.mean = running_mean, a.rstd = 1 / sqrt(running_var + eps).
void launch_batch_norm_running_statistics(const Launch& l, const BatchNormArgs& a, const float* running_mean,
                                          const float* running_var, double eps);
// y (x's dtype, contiguous) = (x - mean) * rstd * weight + bias.
void launch_batch_norm_apply(const Launch& l, const BatchNormArgs& a, void* y);
// dx (x's dtype; null when not wanted) from dy (x's dtype), and the
// parameter gradients grad_weight = sum(dy * xhat), grad_bias = sum(dy)
// (f32 [c]; either may be null). `batch_statistics`: the forward normalised
// by the batch's own statistics, which then depend on x too.
void launch_batch_norm_backward(const Launch& l, const BatchNormArgs& a, const void* dy, void* dx, float* grad_weight,
                                float* grad_bias, bool batch_statistics, void* scratch);

}  // namespace mpt::cuda
