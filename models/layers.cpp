#include "models/layers.h"

#include "amp/fp8_linear.h"
#include "autograd/autocast_hook.h"
#include "autograd/grad_mode.h"
#include "models/init.h"

namespace mpt::nn {

// ---- Linear -------------------------------------------------------------------------------

Linear::Linear(int64_t in, int64_t out, bool with_bias, Generator* gen)
    : Module("Linear"), in_features(in), out_features(out) {
  check(in > 0 && out > 0, "Linear: in_features and out_features must be positive, got ({}, {})", in, out);
  const double bound = init::fan_in_bound(in);
  weight = register_parameter("weight", init::uniform({out, in}, bound, gen));
  if (with_bias) bias = register_parameter("bias", init::uniform({out}, bound, gen));
}

namespace {
void check_linear_input(const Linear& l, const Tensor& x) {
  check<ShapeError>(x.dim() >= 1 && x.size(-1) == l.in_features, "Linear({}, {}): input {} must end in {}",
                    l.in_features, l.out_features, describe(x), l.in_features);
}
}  // namespace

bool Linear::runs_fp8() const { return fp8 && amp::fp8_enabled() && grad_enabled(); }

Tensor Linear::forward(const Tensor& x) {
  check_linear_input(*this, x);
  if (runs_fp8()) return amp::fp8_linear(x, weight, bias, *fp8);
  return linear(x, weight, bias);
}

Tensor Linear::forward_relu(const Tensor& x) {
  check_linear_input(*this, x);
  if (runs_fp8()) return amp::fp8_linear(x, weight, bias, *fp8, DType::bf16, /*relu=*/true);
  return linear_relu(x, weight, bias);
}

Tensor linear_gelu_linear(Linear& fc, Linear& out, const Tensor& x, GeluApprox approx) {
  check_linear_input(fc, x);
  if (fc.runs_fp8() && out.runs_fp8() && fc.fp8->fused_mlp && out.fp8->fused_mlp)
    return amp::fp8_mlp(x, {fc.weight, fc.bias, fc.fp8.get()}, {out.weight, out.bias, out.fp8.get()}, approx);
  return out(gelu(fc(x), approx));
}

// ---- Conv2d -------------------------------------------------------------------------------

Conv2d::Conv2d(int64_t in, int64_t out, int64_t k, int64_t stride, int64_t padding, bool with_bias, Generator* gen)
    : Module("Conv2d"), in_channels(in), out_channels(out), kernel_size(k) {
  check(in > 0 && out > 0 && k > 0, "Conv2d: channels and kernel size must be positive, got ({}, {}, {})", in, out,
        k);
  check(stride > 0 && padding >= 0, "Conv2d: stride must be positive and padding >= 0, got stride {} padding {}",
        stride, padding);
  geometry.stride_h = geometry.stride_w = stride;
  geometry.pad_h = geometry.pad_w = padding;
  // fan_in counts every input a single output sees: channels x window.
  const double bound = init::fan_in_bound(in * k * k);
  weight = register_parameter("weight", init::uniform({out, in, k, k}, bound, gen));
  if (with_bias) bias = register_parameter("bias", init::uniform({out}, bound, gen));
}

Tensor Conv2d::forward(const Tensor& x) {
  check<ShapeError>(x.dim() == 4 && x.size(1) == in_channels, "Conv2d({}, {}, {}): input {} must be [N, {}, H, W]",
                    in_channels, out_channels, kernel_size, describe(x), in_channels);
  return conv2d(x, weight, bias, geometry);
}

// ---- LayerNorm -----------------------------------------------------------------------------

LayerNorm::LayerNorm(int64_t d, double eps) : Module("LayerNorm"), d(d), eps(eps) {
  check(d > 0, "LayerNorm: the normalised size must be positive, got {}", d);
  check(eps >= 0, "LayerNorm: eps must be >= 0, got {}", eps);
  weight = register_parameter("weight", ones({d}));
  bias = register_parameter("bias", zeros({d}));
}

Tensor LayerNorm::forward(const Tensor& x) {
  check<ShapeError>(x.dim() >= 1 && x.size(-1) == d, "LayerNorm({}): input {} must end in {}", d, describe(x), d);
  return layer_norm(x, weight, bias, eps);
}

Tensor LayerNorm::forward_into(const char* consumer, const Tensor& x) {
  check<ShapeError>(x.dim() >= 1 && x.size(-1) == d, "LayerNorm({}): input {} must end in {}", d, describe(x), d);
  return layer_norm(x, weight, bias, eps, autocast_input_dtype(consumer, x));
}

std::pair<Tensor, Tensor> LayerNorm::forward_with_skip(const char* consumer, const Tensor& x) {
  check<ShapeError>(x.dim() >= 1 && x.size(-1) == d, "LayerNorm({}): input {} must end in {}", d, describe(x), d);
  return layer_norm_with_skip(x, weight, bias, eps, autocast_input_dtype(consumer, x));
}

// ---- Embedding -----------------------------------------------------------------------------

Embedding::Embedding(int64_t num, int64_t dim, Generator* gen)
    : Module("Embedding"), num_embeddings(num), embedding_dim(dim) {
  check(num > 0 && dim > 0, "Embedding: sizes must be positive, got ({}, {})", num, dim);
  weight = register_parameter("weight", init::normal({num, dim}, gen));
}

Tensor Embedding::forward(const Tensor& indices) {
  check<DTypeError>(indices.dtype() == DType::i64, "Embedding({}, {}): indices must be i64, got {}",
                    num_embeddings, embedding_dim, describe(indices));
  return embedding(weight, indices);
}

// ---- Dropout -------------------------------------------------------------------------------

Dropout::Dropout(double p, Generator* gen) : Module("Dropout"), p(p), gen_(gen) {
  check(p >= 0.0 && p <= 1.0, "Dropout: p must be in [0, 1], got {}", p);
}

Tensor Dropout::forward(const Tensor& x) {
  if (!is_training() || p == 0.0) return x;
  return dropout(x, p, true, gen_);
}

// ---- MaxPool2d -----------------------------------------------------------------------------

MaxPool2d::MaxPool2d(int64_t kernel_size, std::optional<int64_t> stride, int64_t padding) : Module("MaxPool2d") {
  const int64_t s = stride.value_or(kernel_size);
  check(kernel_size > 0 && s > 0 && padding >= 0,
        "MaxPool2d: kernel {} and stride {} must be positive, padding {} >= 0", kernel_size, s, padding);
  geometry.kernel_h = geometry.kernel_w = kernel_size;
  geometry.stride_h = geometry.stride_w = s;
  geometry.pad_h = geometry.pad_w = padding;
}

Tensor MaxPool2d::forward(const Tensor& x) { return max_pool2d(x, geometry); }

}  // namespace mpt::nn
