#include "models/attention.h"

namespace mpt::nn {

CausalSelfAttention::CausalSelfAttention(int64_t d_model, int64_t n_heads, Generator* gen)
    : Module("CausalSelfAttention"), d_model(d_model), n_heads(n_heads) {
  check(d_model > 0 && n_heads > 0 && d_model % n_heads == 0,
        "CausalSelfAttention: d_model {} must be a positive multiple of n_heads {}", d_model, n_heads);
  // Registration order (qkv, then proj) fixes both the parameter order and
  // the order of random draws, as in the reference.
  qkv = register_module("qkv", std::make_shared<Linear>(d_model, 3 * d_model, true, gen));
  proj = register_module("proj", std::make_shared<Linear>(d_model, d_model, true, gen));
}

Tensor CausalSelfAttention::forward(const Tensor& x) {
  check<ShapeError>(x.dim() == 3 && x.size(2) == d_model, "CausalSelfAttention(d={}, h={}): input {} must be [B, T, {}]",
                    d_model, n_heads, describe(x), d_model);
  const int64_t B = x.size(0), T = x.size(1), C = d_model, H = n_heads;
  // One [B, T, 3C] projection, cut into q | k | v along the channels.
  std::vector<Tensor> qkv_parts = split((*qkv)(x), C, 2);
  for (Tensor& t : qkv_parts) t = transpose(reshape(t, {B, T, H, C / H}), 1, 2);  // [B, H, T, C/H]
  const Tensor y = scaled_dot_product_attention(qkv_parts[0], qkv_parts[1], qkv_parts[2], /*causal=*/true);
  // Heads back side by side: [B, H, T, C/H] -> [B, T, H, C/H] -> [B, T, C].
  return (*proj)(reshape(transpose(y, 1, 2), {B, T, C}));
}

}  // namespace mpt::nn
