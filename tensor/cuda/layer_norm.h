#pragma once
// Internal: the fused layer norm kernels (tensor/cuda/layer_norm.cu).
#include "tensor/cuda/kernels.h"

namespace mpt::cuda {

// Rows of up to this many elements stay in registers (32 per lane).
constexpr int64_t kMaxFusedLayerNorm = 1024;

// x: contiguous [rows, d]; weight, bias: [d] of x's dtype, or null.
struct LayerNormArgs {
  DType dtype;    // x's, weight's, bias's and dx's
  DType y_dtype;  // y's and dy's: x's, or f16 / bf16 where x is f32
  int64_t rows = 0;
  int d = 0;
  const void* x = nullptr;
  const void* weight = nullptr;
  const void* bias = nullptr;
  float* mean = nullptr;  // f32 [rows]: written forward, read backward
  float* rstd = nullptr;  // f32 [rows]
  float eps = 1e-5f;
};

bool fused_layer_norm_supported(DType dtype, DType y_dtype, int64_t d);
void launch_layer_norm_forward(const Launch& l, const LayerNormArgs& a, void* y);
// Rows of the partial sums the backward kernel writes for a's rows.
int64_t layer_norm_backward_partials(const Launch& l, const LayerNormArgs& a);
// partial_w, partial_b: f32 [layer_norm_backward_partials(rows), d];
// dx_more: null, or a gradient of x (x's dtype, contiguous) added into dx;
// dx_narrow: null, or (x f32, dy 16-bit) dx rounded to dy's dtype.
void launch_layer_norm_backward(const Launch& l, const LayerNormArgs& a, const void* dy, const void* dx_more,
                                void* dx, void* dx_narrow, float* partial_w, float* partial_b);
// grad_w, grad_b (f32 [d], either may be null): the partial rows' sums.
void launch_layer_norm_param_grads(const Launch& l, const LayerNormArgs& a, const float* partial_w,
                                   const float* partial_b, float* grad_w, float* grad_b);

}  // namespace mpt::cuda
