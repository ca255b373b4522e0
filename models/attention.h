#pragma once
// Causal multi-head self-attention, laid out exactly like the reference
// GPTBlock (shared/reference/torch_bench.py), so its parameters load from
// and compare against PyTorch by name and shape.
#include <memory>

#include "models/layers.h"

namespace mpt::nn {

// Multi-head causal self-attention, as in the reference GPT block:
// qkv = Linear(d, 3d)(x) split into q, k, v along the last dimension; each
// [B, T, d] -> [B, T, H, d/H] -> [B, H, T, d/H]; causal scaled dot-product
// attention; back to [B, T, d]; proj = Linear(d, d).
class CausalSelfAttention : public Module {
 public:
  CausalSelfAttention(int64_t d_model, int64_t n_heads, Generator* gen = nullptr);
  Tensor forward(const Tensor& x) override;  // x [B, T, d_model]

  int64_t d_model, n_heads;
  std::shared_ptr<Linear> qkv, proj;
};

}  // namespace mpt::nn
