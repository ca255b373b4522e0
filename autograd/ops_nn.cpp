// Neural-network functions: softmax family, losses, normalisation,
// embedding, dropout, convolution, pooling. Softmax, the losses and layer
// norm compute in f32 (f64 for f64 inputs); softmax and layer norm return
// the input dtype, the losses their compute dtype.
#include <cmath>
#include <limits>

#include "autograd/autocast_hook.h"
#include "autograd/function.h"
#include "autograd/grad_utils.h"
#include "autograd/ops.h"
#include "tensor/index_check.h"
#include "tensor/operand_check.h"

namespace mpt {
namespace {

// The dtype these functions compute in: f64 stays f64, all else is f32.
Tensor wide(const Tensor& t) { return prim::to(t, compute_dtype(t.dtype())); }
Tensor as(const Tensor& t, const Tensor& like) { return prim::to(t, like.dtype()); }

Tensor softmax_wide(const Tensor& x32, int64_t dim) {
  const Tensor e = prim::unary(UnaryOp::exp, prim::sub(x32, prim::amax(x32, {dim}, true)));
  return prim::div(e, prim::sum(e, {dim}, true));
}

Tensor log_softmax_wide(const Tensor& x32, int64_t dim) {
  const Tensor z = prim::sub(x32, prim::amax(x32, {dim}, true));
  return prim::sub(z, prim::unary(UnaryOp::log, prim::sum(prim::unary(UnaryOp::exp, z), {dim}, true)));
}

// A floating input and a dimension it has, named by the op the caller called.
void check_softmax_input(const char* op, const Tensor& x, int64_t dim) {
  check_no_float8(op, x);
  check<DTypeError>(is_floating(x.dtype()), "{}: expects a floating input, got {}", op, describe(x));
  normalize_dim(dim, x.dim(), op);
}

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) {
  if (AutocastOp ac{"softmax", {&x}}) return softmax(ac[0], dim);
  check_softmax_input("softmax", x, dim);
  const Tensor y32 = softmax_wide(wide(x), dim);
  Tensor out = prim::to(y32, x.dtype());
  if (needs_grad({x}))
    record("softmax", out, {x}, Saved{y32}, [y32, dim, x](const Grads& g) {
      const Tensor gy = prim::mul(as(g[0], y32), y32);
      return Grads{prim::to(prim::sub(gy, prim::mul(y32, prim::sum(gy, {dim}, true))), x.dtype())};
    });
  return out;
}

Tensor log_softmax(const Tensor& x, int64_t dim) {
  if (AutocastOp ac{"log_softmax", {&x}}) return log_softmax(ac[0], dim);
  check_softmax_input("log_softmax", x, dim);
  const Tensor y32 = log_softmax_wide(wide(x), dim);
  Tensor out = prim::to(y32, x.dtype());
  if (needs_grad({x}))
    record("log_softmax", out, {x}, Saved{y32}, [y32, dim, x](const Grads& g) {
      const Tensor g32 = as(g[0], y32);
      const Tensor gx = prim::sub(g32, prim::mul(prim::unary(UnaryOp::exp, y32), prim::sum(g32, {dim}, true)));
      return Grads{prim::to(gx, x.dtype())};
    });
  return out;
}

Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index, Reduction reduction) {
  if (AutocastOp ac{"cross_entropy", {&logits, &target}}) return cross_entropy(ac[0], ac[1], ignore_index, reduction);
  check_defined("cross_entropy", logits);
  check_defined("cross_entropy", target);
  check<ShapeError>(logits.dim() == 2 && target.dim() == 1 && target.shape()[0] == logits.shape()[0],
                    "cross_entropy: expects logits [N, C] and target [N], got {} and {}", describe(logits),
                    describe(target));
  check_no_float8("cross_entropy", logits);
  check<DTypeError>(is_floating(logits.dtype()), "cross_entropy: logits must be floating, got {}", describe(logits));
  const int64_t classes = logits.shape()[1];
  check<ShapeError>(classes > 0, "cross_entropy: logits {} have no classes", describe(logits));
  check_index_range("cross_entropy", target, classes, ignore_index);
  const Device dev = logits.device();
  check<DeviceError>(target.device() == dev, "cross_entropy: logits {} and target {} are on different devices",
                     describe(logits), describe(target));
  if (prim::fused_cross_entropy_available(logits)) {
    const std::vector<Tensor> r = prim::cross_entropy_forward(logits, target, ignore_index);
    const Tensor& nll = r[0];
    const Tensor lse = r[1], valid = r[2];
    const Tensor count = reduction == Reduction::mean ? prim::sum(valid) : Tensor();
    Tensor out = reduction == Reduction::none  ? nll
                 : reduction == Reduction::sum ? prim::sum(nll)
                                               : prim::div(prim::sum(nll), count);
    if (needs_grad({logits}))
      record("cross_entropy", out, {logits}, Saved{logits, target}, [logits, target, lse, valid, count, reduction](const Grads& g) {
        if (!g[0].defined()) return Grads(1);
        const Tensor g0 = prim::to(g[0], DType::f32);
        // d loss_i / d logits_i = (softmax_i - onehot_i) * row_scale_i.
        const Tensor row_scale = reduction == Reduction::none  ? prim::mul(valid, g0)
                                 : reduction == Reduction::sum ? prim::mul(valid, g0)
                                                               : prim::mul(valid, prim::div(g0, count));
        return Grads{prim::cross_entropy_backward(logits, target, lse, row_scale)};
      });
    return out;
  }
  const DType ct = compute_dtype(logits.dtype());
  const Tensor t32 = prim::unsqueeze(prim::to(target, ct), 1);  // class ids are exact in f32 up to 2^24
  const Tensor onehot = prim::binary(BinaryOp::eq, arange(0, static_cast<double>(classes), 1, ct, dev), t32);
  const Tensor valid = prim::binary(BinaryOp::ne, t32, full({}, static_cast<double>(ignore_index), ct, dev));
  const Tensor logp = log_softmax_wide(wide(logits), 1);
  // The target's log-probability, picked by the one-hot row. A -inf logit
  // (a masked class) has log-probability -inf, and -inf * 0 would be NaN:
  // outside the target the row is first raised to at least -max (the
  // floor is -max there, -inf at the target, which keeps its own value).
  const double lowest = ct == DType::f64 ? -std::numeric_limits<double>::max() : -std::numeric_limits<float>::max();
  const Tensor floor =
      prim::add_scalar(prim::unary(UnaryOp::log, prim::unary(UnaryOp::affine, onehot, -1.0, 1.0)), lowest);
  const Tensor picked = prim::mul(prim::binary(BinaryOp::maximum, logp, floor), onehot);
  // Per-sample loss, zero where ignored.
  const Tensor nll = prim::mul(prim::neg(prim::sum(picked, {1}, true)), valid);  // [N, 1]
  const Tensor count = prim::sum(valid);
  Tensor out;
  switch (reduction) {
    case Reduction::none: out = prim::reshape(nll, {-1}); break;
    case Reduction::sum: out = prim::sum(nll); break;
    case Reduction::mean: out = prim::div(prim::sum(nll), count); break;
  }
  if (needs_grad({logits}))
    record("cross_entropy", out, {logits}, [logp, onehot, valid, count, reduction, logits](const Grads& g) {
      // d loss_i / d logits_i = softmax_i - onehot_i, for rows that count.
      const Tensor g0 = as(g[0], logp);
      Tensor scale = valid;
      if (reduction == Reduction::none) scale = prim::mul(valid, prim::unsqueeze(g0, 1));
      if (reduction == Reduction::sum) scale = prim::mul(valid, g0);
      if (reduction == Reduction::mean) scale = prim::mul(valid, prim::div(g0, count));
      const Tensor d = prim::sub(prim::unary(UnaryOp::exp, logp), onehot);
      return Grads{prim::to(prim::mul(d, scale), logits.dtype())};
    });
  return out;
}

Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction) {
  if (AutocastOp ac{"mse_loss", {&input, &target}}) return mse_loss(ac[0], ac[1], reduction);
  check<ShapeError>(input.shape() == target.shape(), "mse_loss: input {} and target {} differ in shape",
                    describe(input), describe(target));
  check_no_float8("mse_loss", input);
  check_no_float8("mse_loss", target);
  const Tensor d = sub(to(input, compute_dtype(input.dtype())), to(target, compute_dtype(input.dtype())));
  const Tensor sq = mul(d, d);
  switch (reduction) {
    case Reduction::none: return sq;
    case Reduction::sum: return sum(sq);
    case Reduction::mean: break;
  }
  return mean(sq);
}

Tensor binary_cross_entropy_with_logits(const Tensor& logits, const Tensor& target, Reduction reduction,
                                        const Tensor& pos_weight) {
  check_floating("binary_cross_entropy_with_logits", logits);  // (defined, too)
  check_floating("binary_cross_entropy_with_logits", target);
  check<ShapeError>(logits.shape() == target.shape(),
                    "binary_cross_entropy_with_logits: logits {} and target {} differ in shape", describe(logits),
                    describe(target));
  check_same_device("binary_cross_entropy_with_logits", logits, target);
  // In f32 (f64 for f64) whatever the logits' dtype, as PyTorch's autocast
  // would cast them: the loss is a sum of many small terms.
  const DType ct = compute_dtype(logits.dtype());
  const Tensor x = to(logits, ct), y = to(target, ct);
  // (1 - y) x + w (log(1 + e^-|x|) + max(-x, 0)), w = 1 + (pos_weight - 1) y:
  // no exp of a positive number, so no overflow for any logit.
  const Tensor negative_part = relu(neg(x));
  const Tensor magnitude = add(relu(x), negative_part);
  Tensor log_term = add(log(add(exp(neg(magnitude)), 1.0)), negative_part);
  if (pos_weight.defined()) {
    check_floating("binary_cross_entropy_with_logits", pos_weight);
    check_same_device("binary_cross_entropy_with_logits", logits, pos_weight);
    check<ShapeError>(broadcasts_to(pos_weight.shape(), logits.shape()),
                      "binary_cross_entropy_with_logits: pos_weight {} does not broadcast to logits {}",
                      describe(pos_weight), describe(logits));
    log_term = mul(add(mul(add(to(pos_weight, ct), -1.0), y), 1.0), log_term);
  }
  const Tensor loss = add(mul(add(neg(y), 1.0), x), log_term);
  switch (reduction) {
    case Reduction::none: return loss;
    case Reduction::sum: return sum(loss);
    case Reduction::mean: break;
  }
  return mean(loss);
}

namespace {
void check_layer_norm_args(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                           std::optional<DType> out_dtype) {
  check_defined("layer_norm", x);
  for (const Tensor* t : {&x, &weight, &bias}) check_no_float8("layer_norm", *t);
  check<ShapeError>(x.dim() >= 1, "layer_norm: input must have at least one dimension, got {}", describe(x));
  check(std::isfinite(eps) && eps >= 0, "layer_norm: eps must be finite and >= 0, got {}", eps);
  const int64_t d = x.shape().back();
  for (const Tensor* p : {&weight, &bias})
    check<ShapeError>(!p->defined() || p->shape() == Shape{d}, "layer_norm: parameter {} does not match input {}",
                      describe(*p), describe(x));
  check<DTypeError>(!out_dtype || (is_floating(*out_dtype) && !is_float8(*out_dtype)),
                    "layer_norm: the output dtype must be f32, f16, bf16 or f64, got {}",
                    dtype_name(out_dtype.value_or(x.dtype())));
}

// The fused kernel's gradients of x, weight and bias from the norm's
// gradient g, with g_skip (when defined) added into x's.
Grads fused_layer_norm_grads(const Tensor& g, const Tensor& g_skip, const Tensor& x, const Tensor& weight,
                             const Tensor& bias, const Tensor& mean, const Tensor& rstd) {
  const bool want_w = weight.defined() && weight.requires_grad();
  const bool want_b = bias.defined() && bias.requires_grad();
  std::vector<Tensor> grads = prim::layer_norm_backward(g, x, weight, mean, rstd, want_w, want_b, g_skip);
  if (want_w) grads[1] = prim::to(grads[1], weight.dtype());
  if (want_b) grads[2] = prim::to(grads[2], bias.dtype());
  return grads;
}
}  // namespace

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                  std::optional<DType> out_dtype) {
  if (AutocastOp ac{"layer_norm", {&x, &weight, &bias}}) return layer_norm(ac[0], ac[1], ac[2], eps, out_dtype);
  check_layer_norm_args(x, weight, bias, eps, out_dtype);
  const DType y_dtype = out_dtype.value_or(x.dtype());
  if (prim::fused_layer_norm_available(x, weight, bias, y_dtype)) {
    std::vector<Tensor> r = prim::layer_norm_forward(x, weight, bias, eps, y_dtype);
    Tensor out = r[0];
    if (needs_grad({x, weight, bias})) {
      const Tensor mean = r[1], rstd = r[2];
      record("layer_norm", out, {x, weight, bias}, Saved{x, weight}, [x, weight, bias, mean, rstd](const Grads& g) {
        if (!g[0].defined()) return Grads(3);
        return fused_layer_norm_grads(g[0], Tensor(), x, weight, bias, mean, rstd);
      });
    }
    return out;
  }
  const Tensor x32 = wide(x);
  const Tensor xc = prim::sub(x32, prim::mean(x32, {-1}, true));
  const Tensor rstd =
      prim::unary(UnaryOp::rsqrt, prim::add_scalar(prim::mean(prim::unary(UnaryOp::square, xc), {-1}, true), eps));
  const Tensor xhat = prim::mul(xc, rstd);
  Tensor y = xhat;
  if (weight.defined()) y = prim::mul(y, as(weight, x32));
  if (bias.defined()) y = prim::add(y, as(bias, x32));
  Tensor out = prim::to(y, y_dtype);
  if (needs_grad({x, weight, bias}))
    record("layer_norm", out, {x, weight, bias}, Saved{weight}, [x, weight, bias, xhat, rstd](const Grads& g) {
      const Tensor gy = as(g[0], xhat);
      std::vector<int64_t> batch_dims(static_cast<size_t>(x.dim() - 1));
      for (size_t i = 0; i < batch_dims.size(); ++i) batch_dims[i] = static_cast<int64_t>(i);
      // Summed over the batch dimensions; a 1-d input has none (and an
      // empty list would sum over everything).
      const auto over_batch = [&](const Tensor& t) { return batch_dims.empty() ? t : prim::sum(t, batch_dims); };
      Tensor gw, gb;
      if (weight.defined() && weight.requires_grad()) gw = prim::to(over_batch(prim::mul(gy, xhat)), weight.dtype());
      if (bias.defined() && bias.requires_grad()) gb = prim::to(over_batch(gy), bias.dtype());
      const Tensor gxhat = weight.defined() ? prim::mul(gy, as(weight, xhat)) : gy;
      // dx = rstd * (gxhat - mean(gxhat) - xhat * mean(gxhat * xhat))
      const Tensor inner = prim::sub(prim::sub(gxhat, prim::mean(gxhat, {-1}, true)),
                                     prim::mul(xhat, prim::mean(prim::mul(gxhat, xhat), {-1}, true)));
      return Grads{prim::to(prim::mul(inner, rstd), x.dtype()), gw, gb};
    });
  return out;
}

std::pair<Tensor, Tensor> layer_norm_with_skip(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                                               std::optional<DType> out_dtype) {
  const DType y_dtype = out_dtype.value_or(x.dtype());
  // The fused node needs x as the norm reads it (autocast would not re-type
  // it) and the fused kernel; else the two results are composed as usual.
  const bool fused = x.defined() && autocast_input_dtype("layer_norm", x) == x.dtype() &&
                     (!weight.defined() || autocast_input_dtype("layer_norm", weight) == weight.dtype()) &&
                     (!bias.defined() || autocast_input_dtype("layer_norm", bias) == bias.dtype()) &&
                     needs_grad({x, weight, bias}) && prim::fused_layer_norm_available(x, weight, bias, y_dtype);
  if (!fused) return {x, layer_norm(x, weight, bias, eps, out_dtype)};
  check_layer_norm_args(x, weight, bias, eps, out_dtype);
  std::vector<Tensor> r = prim::layer_norm_forward(x, weight, bias, eps, y_dtype);
  std::vector<Tensor> outs{Tensor::view_of(x.storage(), x.shape(), x.strides(), x.offset(), x.dtype()), r[0]};
  const Tensor mean = r[1], rstd = r[2];
  record("layer_norm_with_skip", outs, {x, weight, bias}, Saved{x, weight}, [x, weight, bias, mean, rstd](const Grads& g) {
    if (!g[1].defined()) return Grads{g[0].defined() ? prim::to(g[0], x.dtype()) : Tensor(), Tensor(), Tensor()};
    return fused_layer_norm_grads(g[1], g[0], x, weight, bias, mean, rstd);
  });
  return {outs[0], outs[1]};
}

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  check_defined("embedding", weight);
  check_defined("embedding", indices);
  check<ShapeError>(weight.dim() == 2, "embedding: weight must be [num, dim], got {}", describe(weight));
  check_index_range("embedding", indices, weight.shape()[0]);
  Tensor out = prim::index_select_rows(weight, indices);
  if (needs_grad({weight}))
    record("embedding", out, {weight}, Saved{indices}, [weight, indices](const Grads& g) {
      // Summed in f32 for a 16-bit table, as PyTorch sums: a row that many
      // tokens share adds thousands of small gradients, and a 16-bit sum
      // stops growing once it is 256 (bf16) or 2048 (f16) times each one.
      const DType sum_dtype = compute_dtype(weight.dtype());
      Tensor gw = zeros(weight.shape(), sum_dtype, weight.device());
      prim::index_add_rows_(gw, indices, prim::to(g[0], sum_dtype));
      return Grads{prim::to(gw, weight.dtype())};
    });
  return out;
}

Tensor dropout(const Tensor& x, double p, bool training, Generator* gen) {
  check(p >= 0.0 && p <= 1.0, "dropout: probability must be in [0, 1], got {}", p);
  check_no_float8("dropout", x);
  if (!training || p == 0.0) return x;
  // keep = (u >= p) / (1 - p), drawn and scaled in f32 (f64 for f64) as
  // PyTorch does: in 16 bits the draws are coarse and 1 / (1 - p) rounds
  // (to 1.109375 for p = 0.1 in bf16), which would shrink every kept value
  // alike. Each output is x * keep rounded once to x's dtype. p == 1 drops
  // everything.
  const DType wide = compute_dtype(x.dtype());
  const Tensor u = rand(x.shape(), wide, x.device(), gen);
  const Tensor keep = prim::unary(UnaryOp::affine, prim::binary(BinaryOp::ge, u, full({}, p, wide, x.device())),
                                  p < 1.0 ? 1.0 / (1.0 - p) : 0.0, 0.0);
  const auto apply = [keep](const Tensor& t) { return prim::to(prim::mul(t, keep), t.dtype()); };
  Tensor out = apply(x);
  if (needs_grad({x})) record("dropout", out, {x}, [apply](const Grads& g) { return Grads{apply(g[0])}; });
  return out;
}

Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias, const Conv2dParams& p) {
  if (AutocastOp ac{"conv2d", {&x, &weight, &bias}}) return conv2d(ac[0], ac[1], ac[2], p);
  Tensor y = prim::conv2d(x, weight, p);  // checks x and weight
  if (bias.defined()) {
    check<ShapeError>(bias.shape() == Shape{weight.shape()[0]}, "conv2d: bias {} does not match weight {}",
                      describe(bias), describe(weight));
    // As linear: a bias of another dtype would promote the output, and the
    // backward's convolutions would then meet operands of two dtypes.
    check<DTypeError>(bias.dtype() == weight.dtype(), "conv2d: bias {} and weight {} differ in dtype",
                      describe(bias), describe(weight));
    y = prim::add(y, prim::reshape(bias, {1, weight.shape()[0], 1, 1}));
  }
  Tensor out = y;
  if (needs_grad({x, weight, bias}))
    record("conv2d", out, {x, weight, bias}, Saved{x, weight}, [x, weight, bias, p](const Grads& g) {
      const Tensor go = prim::contiguous(g[0]);
      Tensor gx, gw, gb;
      if (x.requires_grad()) gx = prim::conv2d_backward_data(go, weight, x.shape(), p);
      if (weight.requires_grad()) gw = prim::conv2d_backward_weight(x, go, weight.shape(), p);
      if (bias.defined() && bias.requires_grad()) gb = prim::to(prim::sum(go, {0, 2, 3}), bias.dtype());
      return Grads{gx, gw, gb};
    });
  return out;
}

Tensor max_pool2d(const Tensor& x, const Pool2dParams& p) {
  auto [out, indices] = prim::max_pool2d(x, p);
  if (needs_grad({x}))
    record("max_pool2d", out, {x}, [x, indices = indices, p](const Grads& g) {
      return Grads{prim::max_pool2d_backward(g[0], indices, x.shape(), p)};
    });
  return out;
}

namespace {

// max(x, floor), the gradient passing to x where x is kept.
Tensor at_least(const Tensor& x, const Tensor& floor) {
  Tensor out = prim::binary(BinaryOp::maximum, x, floor);
  if (needs_grad({x}))
    record("scaled_dot_product_attention", out, {x}, [x, floor](const Grads& g) {
      return Grads{prim::mul(g[0], prim::binary(BinaryOp::ge, x, floor))};
    });
  return out;
}

// attn_mask broadcasts to the scores [B, H, Tq, Tk], lives with q, and is
// either u8 (nonzero: the key takes part) or floating (added to the scores).
void check_attention_mask(const Tensor& mask, const Tensor& q, const Tensor& k) {
  check_same_device("scaled_dot_product_attention", q, mask);
  check_no_float8("scaled_dot_product_attention", mask);
  if (mask.dtype() != DType::u8 && !is_floating(mask.dtype()))
    throw DTypeError(fmt::format("scaled_dot_product_attention: attn_mask {} must be u8 (nonzero keeps a key) or "
                                 "floating (added to the scores)",
                                 describe(mask)));
  const Shape scores{q.size(0), q.size(1), q.size(2), k.size(2)};
  if (!broadcasts_to(mask.shape(), scores))
    throw ShapeError(fmt::format(
        "scaled_dot_product_attention: attn_mask {} does not broadcast to the scores {} of q {} and k {}",
        describe(mask), shape_str(scores), describe(q), describe(k)));
}

}  // namespace

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                    std::optional<double> scale, const Tensor& attn_mask) {
  if (AutocastOp ac{"scaled_dot_product_attention", {&q, &k, &v}})
    return scaled_dot_product_attention(ac[0], ac[1], ac[2], causal, scale, attn_mask);
  for (const Tensor* t : {&q, &k, &v}) {
    check_defined("scaled_dot_product_attention", *t);
    check_no_float8("scaled_dot_product_attention", *t);
  }
  // (Messages made only for a failure: this runs at every forward.)
  const bool four_dims = q.dim() == 4 && k.dim() == 4 && v.dim() == 4;
  if (!(four_dims && k.shape() == v.shape() && q.size(0) == k.size(0) && q.size(1) == k.size(1) &&
        q.size(3) == k.size(3)))
    throw ShapeError(
        fmt::format("scaled_dot_product_attention: expects q [B, H, Tq, D] and k, v [B, H, Tk, D], got {}, {}, {}",
                    describe(q), describe(k), describe(v)));
  const int64_t tq = q.shape()[2], tk = k.shape()[2];
  if (causal && tq > tk)
    throw ShapeError(fmt::format("scaled_dot_product_attention: a causal mask puts the {} queries at the end of the "
                                 "keys, but q {} has more than the {} keys of k {}",
                                 tq, describe(q), tk, describe(k)));
  if (attn_mask.defined()) check_attention_mask(attn_mask, q, k);
  const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(q.shape()[3])));
  if (!attn_mask.defined() && prim::fused_attention_available(q, k, v)) {
    // One kernel each way; the [T, T] scores never reach memory.
    auto [out, lse_of_rows] = prim::attention_forward(q, k, v, causal, s);
    if (needs_grad({q, k, v})) {
      const Tensor saved_out = detach(out);  // not `out` itself: the node must not own its own output
      const Tensor lse = lse_of_rows;        // a named copy: clang cannot capture a structured binding
      record("scaled_dot_product_attention", out, {q, k, v}, Saved{q, k, v, saved_out},
             [q, k, v, saved_out, lse, causal, s](const Grads& g) {
        if (!g[0].defined()) return Grads(3);
        return Grads(prim::attention_backward(q, k, v, saved_out, lse, g[0], causal, s));
      });
    }
    return out;
  }
  Tensor scores = mul(matmul(q, transpose(k, -1, -2)), s);
  if (causal && tq > 1) {  // a single query, at the end, sees every key
    // 0 where a key is at or before its query, -inf after it (log of the
    // keep mask); query i sits at key position tk - tq + i. Positions in f32
    // (exact to 2^24): in bf16 (f16) neighbours above 256 (2048) round to one
    // value, and a query would see the key after it.
    const Tensor rows = prim::unsqueeze(
        arange(static_cast<double>(tk - tq), static_cast<double>(tk), 1, DType::f32, q.device()), 1);
    const Tensor cols = prim::unsqueeze(arange(0, static_cast<double>(tk), 1, DType::f32, q.device()), 0);
    const Tensor keep = prim::to(prim::binary(BinaryOp::le, cols, rows), scores.dtype());
    scores = add(scores, prim::unary(UnaryOp::log, keep));
  }
  if (!attn_mask.defined()) return matmul(softmax(scores, -1), v);
  if (attn_mask.dtype() == DType::u8) {
    const Tensor none = zeros({}, scores.dtype(), q.device());
    const Tensor keep = prim::binary(BinaryOp::ne, prim::to(attn_mask, scores.dtype()), none);
    scores = add(scores, prim::unary(UnaryOp::log, keep));  // -inf where a key is left out
  } else {
    scores = add(scores, to(attn_mask, scores.dtype()));  // differentiable: a learned bias gets its gradient
  }
  // A query whose keys are all masked out gets zeros, with zero gradients,
  // as from PyTorch's _safe_softmax, not the NaN of a softmax over -inf
  // alone (which a loss would carry even where it ignores the row): its
  // scores are lifted to 0 for the softmax and its output multiplied by 0.
  const Tensor minus_inf = full({}, -std::numeric_limits<double>::infinity(), scores.dtype(), q.device());
  const Tensor live = prim::binary(BinaryOp::gt, prim::amax(scores, {-1}, true), minus_inf);  // 1 or 0 a query
  const Tensor floor = prim::unary(UnaryOp::log, prim::add_scalar(prim::mul_scalar(live, -1.0), 1.0));  // -inf or 0
  return mul(matmul(softmax(at_least(scores, floor), -1), v), live);
}

}  // namespace mpt
