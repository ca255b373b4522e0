#pragma once
// GPT-mini, laid out exactly like the reference GPTMini/GPTBlock
// (shared/reference/torch_bench.py) so its state dict loads by name in
// PyTorch: tok, pos embeddings; blocks.<i> with ln1, ln2, qkv, proj, fc,
// out; a final ln; an untied head without bias. Pre-LayerNorm blocks:
//   x = x + proj(causal_attention(qkv(ln1(x))))
//   x = x + out(gelu(fc(ln2(x))))
#include <memory>
#include <vector>

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

// GPT-2 small's sizes (124M parameters with a tied head; 163M here, whose
// head is untied): 12 layers, 12 heads, d 768, context 1024, and GPT-2's
// vocabulary of 50257 padded to 50304 (a multiple of 128) as llm.c and
// nanoGPT pad it.
GPTOptions gpt2_small_options();

// What a GPT has read when it reads a sequence a few tokens at a time (as
// sampling does): each block's keys and values of the positions so far, so
// that a new token costs one position's work, not the whole window's.
struct GPTCache {
  std::vector<Tensor> keys, values;  // per block, [B, H, context, d/H]: the first `length` positions written
  int64_t length = 0;                // positions read so far
};

class GPTBlock : public Module {
 public:
  GPTBlock(int64_t d_model, int64_t n_heads, Generator* gen = nullptr);
  Tensor forward(const Tensor& x) override;  // [B, T, d] -> [B, T, d]
  // x [B, n, d] at positions past .. past + n - 1, each attending to the
  // keys and values of every position up to its own: those of the n new
  // positions are written into `keys` and `values` first (made [B, H,
  // capacity, d/H] when undefined, in the dtype the projection writes). No
  // gradients are recorded.
  Tensor forward_cached(const Tensor& x, Tensor& keys, Tensor& values, int64_t past, int64_t capacity);

  int64_t d_model, n_heads;
  std::shared_ptr<LayerNorm> ln1, ln2;
  std::shared_ptr<Linear> qkv, proj, fc, out;
};

class GPT : public Module {
 public:
  explicit GPT(const GPTOptions& options = {}, Generator* gen = nullptr);
  // Token indices i64 [B, T] (T <= context) -> logits [B, T, vocab_size].
  Tensor forward(const Tensor& idx) override;
  // The next tokens of sequences already read into `cache` (empty at
  // first): idx i64 [B, n] at positions cache.length onwards, which must
  // stay within the context. Returns the logits [B, vocab_size] of the last
  // one, as forward() on the whole sequence would give them (to rounding),
  // and extends the cache. No gradients are recorded.
  Tensor forward_cached(const Tensor& idx, GPTCache& cache);

  // The matrix-multiply FLOPs of one training step (forward and backward)
  // per token of sequences of length T, as MFU is counted (PaLM's
  // appendix B, llm.c): 6 per weight of every matrix product (the blocks'
  // and the head's; embeddings are lookups) plus 12 * layers * d * T for
  // attention's two products, the causal mask's skipped half included.
  double training_flops_per_token(int64_t T) const;

  GPTOptions options;
  std::shared_ptr<Embedding> tok, pos;
  std::shared_ptr<Sequential> blocks;
  std::shared_ptr<LayerNorm> ln;
  std::shared_ptr<Linear> head;
};

}  // namespace mpt::nn
