#pragma once
// GPT-mini, laid out exactly like the reference GPTMini/GPTBlock
// (shared/reference/torch_bench.py) so its state dict loads by name in
// PyTorch: tok, pos embeddings; blocks.<i> with ln1, ln2, qkv, proj, fc,
// out; a final ln; an untied head without bias. Pre-LayerNorm blocks:
//   x = x + proj(causal_attention(qkv(ln1(x))))
//   x = x + out(gelu(fc(ln2(x))))
#include <memory>

#include "models/layers.h"
#include "models/sequential.h"

namespace mpt::nn {

struct GPTOptions {
  int64_t vocab_size = 65;
  int64_t context = 256;  // longest sequence (rows of the position table)
  int64_t d_model = 384;
  int64_t n_layers = 6;
  int64_t n_heads = 6;
};

class GPTBlock : public Module {
 public:
  GPTBlock(int64_t d_model, int64_t n_heads, Generator* gen = nullptr);
  Tensor forward(const Tensor& x) override;  // [B, T, d] -> [B, T, d]

  int64_t d_model, n_heads;
  std::shared_ptr<LayerNorm> ln1, ln2;
  std::shared_ptr<Linear> qkv, proj, fc, out;
};

class GPT : public Module {
 public:
  explicit GPT(const GPTOptions& options = {}, Generator* gen = nullptr);
  // Token indices i64 [B, T] (T <= context) -> logits [B, T, vocab_size].
  Tensor forward(const Tensor& idx) override;

  GPTOptions options;
  std::shared_ptr<Embedding> tok, pos;
  std::shared_ptr<Sequential> blocks;
  std::shared_ptr<LayerNorm> ln;
  std::shared_ptr<Linear> head;
};

}  // namespace mpt::nn
