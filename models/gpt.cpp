#include "models/gpt.h"

#include "autograd/grad_mode.h"

namespace mpt::nn {

GPTBlock::GPTBlock(int64_t d_model, int64_t n_heads, Generator* gen)
    : Module("GPTBlock"), d_model(d_model), n_heads(n_heads) {
  check(d_model > 0 && n_heads > 0 && d_model % n_heads == 0,
        "GPTBlock: d_model {} must be a positive multiple of n_heads {}", d_model, n_heads);
  // The reference's registration order, which is also its state-dict order.
  ln1 = register_module("ln1", std::make_shared<LayerNorm>(d_model));
  ln2 = register_module("ln2", std::make_shared<LayerNorm>(d_model));
  qkv = register_module("qkv", std::make_shared<Linear>(d_model, 3 * d_model, true, gen));
  proj = register_module("proj", std::make_shared<Linear>(d_model, d_model, true, gen));
  fc = register_module("fc", std::make_shared<Linear>(d_model, 4 * d_model, true, gen));
  out = register_module("out", std::make_shared<Linear>(4 * d_model, d_model, true, gen));
}

Tensor GPTBlock::forward(const Tensor& x) {
  check<ShapeError>(x.dim() == 3 && x.size(2) == d_model, "GPTBlock(d={}, h={}): input {} must be [B, T, {}]",
                    d_model, n_heads, describe(x), d_model);
  const int64_t B = x.size(0), T = x.size(1), C = d_model, H = n_heads;
  // Each norm writes the dtype of the linear layer it feeds, and passes its
  // input on for the residual sum (so backward adds the input's two
  // gradients inside the norm's kernel).
  const auto [x_skip, a] = ln1->forward_with_skip("linear", x);
  std::vector<Tensor> qkv_parts = split((*qkv)(a), C, 2);
  for (Tensor& t : qkv_parts) t = transpose(reshape(t, {B, T, H, C / H}), 1, 2);  // [B, H, T, C/H]
  const Tensor y = scaled_dot_product_attention(qkv_parts[0], qkv_parts[1], qkv_parts[2], /*causal=*/true);
  const Tensor h = x_skip + (*proj)(reshape(transpose(y, 1, 2), {B, T, C}));
  const auto [h_skip, m] = ln2->forward_with_skip("linear", h);
  return h_skip + linear_gelu_linear(*fc, *out, m);
}

Tensor GPTBlock::forward_cached(const Tensor& x, Tensor& keys, Tensor& values, int64_t past, int64_t capacity) {
  NoGradGuard no_grad;
  const int64_t B = x.size(0), n = x.size(1), C = d_model, H = n_heads;
  const auto [x_skip, a] = ln1->forward_with_skip("linear", x);
  std::vector<Tensor> qkv_parts = split((*qkv)(a), C, 2);
  for (Tensor& t : qkv_parts) t = transpose(reshape(t, {B, n, H, C / H}), 1, 2);  // [B, H, n, C/H]
  if (!keys.defined()) {
    keys = Tensor::empty({B, H, capacity, C / H}, qkv_parts[1].dtype(), x.device());
    values = Tensor::empty({B, H, capacity, C / H}, qkv_parts[2].dtype(), x.device());
  }
  prim::copy_(prim::slice(keys, 2, past, past + n), qkv_parts[1]);
  prim::copy_(prim::slice(values, 2, past, past + n), qkv_parts[2]);
  const Tensor k = prim::slice(keys, 2, 0, past + n), v = prim::slice(values, 2, 0, past + n);
  // The new queries sit at the end of the keys so far, each seeing those up
  // to its own position.
  const Tensor y = scaled_dot_product_attention(qkv_parts[0], k, v, /*causal=*/true);
  const Tensor h = x_skip + (*proj)(reshape(transpose(y, 1, 2), {B, n, C}));
  const auto [h_skip, m] = ln2->forward_with_skip("linear", h);
  return h_skip + linear_gelu_linear(*fc, *out, m);
}

GPT::GPT(const GPTOptions& o, Generator* gen) : Module("GPT"), options(o) {
  check(o.vocab_size > 0 && o.context > 0 && o.n_layers >= 0,
        "GPT: vocab_size {}, context {} must be positive and n_layers {} not negative", o.vocab_size, o.context,
        o.n_layers);
  tok = register_module("tok", std::make_shared<Embedding>(o.vocab_size, o.d_model, gen));
  pos = register_module("pos", std::make_shared<Embedding>(o.context, o.d_model, gen));
  blocks = register_module("blocks", std::make_shared<Sequential>());
  for (int64_t i = 0; i < o.n_layers; ++i) blocks->push_back(std::make_shared<GPTBlock>(o.d_model, o.n_heads, gen));
  ln = register_module("ln", std::make_shared<LayerNorm>(o.d_model));
  head = register_module("head", std::make_shared<Linear>(o.d_model, o.vocab_size, false, gen));
}

Tensor GPT::forward(const Tensor& idx) {
  check<ShapeError>(idx.dim() == 2 && idx.size(1) >= 1 && idx.size(1) <= options.context,
                    "GPT: input {} must be [B, T] token indices with 1 <= T <= context {}", describe(idx),
                    options.context);
  check<DTypeError>(idx.dtype() == DType::i64, "GPT: input {} must hold i64 token indices", describe(idx));
  const int64_t T = idx.size(1);
  const Tensor positions = arange(0, static_cast<double>(T), 1, DType::i64, idx.device());
  const Tensor x = (*tok)(idx) + (*pos)(positions);
  return (*head)(ln->forward_into("linear", blocks->forward(x)));
}

GPTOptions gpt2_small_options() { return {.vocab_size = 50304, .context = 1024, .d_model = 768, .n_layers = 12, .n_heads = 12}; }

double GPT::training_flops_per_token(int64_t T) const {
  const double d = static_cast<double>(options.d_model), layers = static_cast<double>(options.n_layers);
  const double block_weights = 12.0 * d * d;  // qkv 3d^2, proj d^2, fc 4d^2, out 4d^2
  const double matmul_weights = layers * block_weights + d * static_cast<double>(options.vocab_size);
  return 6.0 * matmul_weights + 12.0 * layers * d * static_cast<double>(T);
}

Tensor GPT::forward_cached(const Tensor& idx, GPTCache& cache) {
  NoGradGuard no_grad;
  check<ShapeError>(idx.dim() == 2 && idx.size(1) >= 1, "GPT::forward_cached: input {} must be [B, n] token indices",
                    describe(idx));
  check<DTypeError>(idx.dtype() == DType::i64, "GPT::forward_cached: input {} must hold i64 token indices",
                    describe(idx));
  const int64_t B = idx.size(0), n = idx.size(1), past = cache.length;
  check<ShapeError>(past + n <= options.context,
                    "GPT::forward_cached: {} positions read and {} more exceed the context of {}", past, n,
                    options.context);
  const Tensor positions =
      arange(static_cast<double>(past), static_cast<double>(past + n), 1, DType::i64, idx.device());
  Tensor x = (*tok)(idx) + (*pos)(positions);
  if (cache.keys.empty()) {
    cache.keys.resize(blocks->size());
    cache.values.resize(blocks->size());
  }
  const Shape cache_shape{B, options.n_heads, options.context, options.d_model / options.n_heads};
  const bool filled = !cache.keys.empty() && cache.keys[0].defined();
  if (cache.keys.size() != blocks->size() ||
      (filled && (cache.keys[0].shape() != cache_shape || cache.keys[0].device() != idx.device())))
    throw ShapeError(fmt::format("GPT::forward_cached: the cache holds another model's or batch's positions ({} "
                                 "blocks, keys {}; here {} blocks, keys {} on {})",
                                 cache.keys.size(), filled ? describe(cache.keys[0]).str() : "none yet",
                                 blocks->size(), shape_str(cache_shape), idx.device().str()));
  for (size_t i = 0; i < blocks->size(); ++i)
    x = static_cast<GPTBlock&>(*(*blocks)[i]).forward_cached(x, cache.keys[i], cache.values[i], past, options.context);
  cache.length = past + n;
  const Tensor last = prim::slice(x, 1, n - 1, n);  // [B, 1, d]
  return reshape((*head)(ln->forward_into("linear", last)), {B, options.vocab_size});
}

}  // namespace mpt::nn
