#pragma once
// Internal: the fused cross-entropy kernels (tensor/cuda/cross_entropy.cu).
#include "tensor/cuda/kernels.h"

namespace mpt::cuda {

// logits: contiguous [rows, classes]; target: i64 [rows], each in
// [0, classes) or ignore_index (checked by the caller).
struct CrossEntropyArgs {
  int64_t rows = 0;
  int64_t classes = 0;
  const void* logits = nullptr;
  const int64_t* target = nullptr;
  float* lse = nullptr;  // f32 [rows]: written forward, read backward
  int64_t ignore_index = -100;
};

bool fused_cross_entropy_supported(DType dtype);
// loss, valid: f32 [rows] (loss 0 and valid 0 where the target is ignored).
void launch_cross_entropy_forward(const Launch& l, DType dtype, const CrossEntropyArgs& a, float* loss, float* valid);
// grad = (softmax(logits) - onehot(target)) * row_scale[row], logits' dtype.
void launch_cross_entropy_backward(const Launch& l, DType dtype, const CrossEntropyArgs& a, const float* row_scale,
                                   void* grad);

}  // namespace mpt::cuda
