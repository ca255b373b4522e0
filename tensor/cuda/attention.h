#pragma once
// Internal: the fused attention kernels (tensor/cuda/attention.cu).
#include "tensor/cuda/kernels.h"

namespace mpt::cuda {

// q, k, v, out: contiguous [batch_heads, len, head_dim] of `dtype`;
// lse: f32 [batch_heads, len], the log-sum-exp of each row of scaled scores.
struct AttentionArgs {
  DType dtype;
  int64_t batch_heads = 0;
  int len = 0;
  int64_t head_dim = 0;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;  // written by the forward pass, read by the backward
  float* lse = nullptr;
  double scale = 1.0;
  bool causal = false;
};

struct AttentionGrads {
  const void* grad_out = nullptr;
  float* grad_q = nullptr;  // f32, zeroed by the caller (accumulated with atomics)
  void* grad_k = nullptr;
  void* grad_v = nullptr;
  float* delta = nullptr;   // f32 [batch_heads, len] scratch
};

bool fused_attention_supported(DType dtype, int64_t head_dim);
void launch_attention_forward(const Launch& l, const AttentionArgs& a);
void launch_attention_backward(const Launch& l, const AttentionArgs& a, const AttentionGrads& g);

}  // namespace mpt::cuda
