#pragma once
// Internal: the fused attention kernels (tensor/cuda/attention.cu).
#include "tensor/cuda/kernels.h"

namespace mpt::cuda {

// Where the rows of one [B, H, T, D] operand lie, in elements: (b, h, t) starts
// at b * batch + h * head + t * row, and its D elements are contiguous.
struct AttentionLayout {
  int64_t batch = 0, head = 0, row = 0;
};

// q, k, v, out: [batch, heads, len, head_dim] of `dtype` laid out as their
// AttentionLayouts say (rows 16-byte aligned); lse: f32 contiguous
// [batch, heads, len], the log-sum-exp of each row of scaled scores.
struct AttentionArgs {
  DType dtype;
  int64_t batch = 0, heads = 0;
  int len = 0;
  int64_t head_dim = 0;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;  // written by the forward pass, read by the backward
  AttentionLayout q_layout, k_layout, v_layout, out_layout;
  float* lse = nullptr;
  double scale = 1.0;
  bool causal = false;
};

struct AttentionGrads {
  const void* grad_out = nullptr;
  AttentionLayout grad_out_layout;
  void* grad_q = nullptr;
  AttentionLayout grad_q_layout;
  void* grad_k = nullptr;
  AttentionLayout grad_k_layout;
  void* grad_v = nullptr;
  AttentionLayout grad_v_layout;
  float* delta = nullptr;   // f32 [batch, heads, len] scratch
};

bool fused_attention_supported(DType dtype, int64_t head_dim);
// The longest sequence the kernels take: tiles of 64 queries or keys go
// along the grid's y dimension, which holds at most 65535 blocks.
inline constexpr int64_t kAttentionMaxLength = int64_t{65535} * 64;
void launch_attention_forward(const Launch& l, const AttentionArgs& a);
void launch_attention_backward(const Launch& l, const AttentionArgs& a, const AttentionGrads& g);

}  // namespace mpt::cuda
