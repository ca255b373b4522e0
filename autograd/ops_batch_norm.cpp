// batch_norm: per-channel normalisation over the batch (and spatial)
// dimensions, as torch.nn.functional.batch_norm. Where the device has fused
// kernels (CUDA, f32/f16/bf16 input, f32 per-channel tensors), one forward
// and one backward call that keep only the per-channel mean and 1/std;
// elsewhere composed of raw ops in f32 (f64 for f64 inputs) with one
// backward rule. The output has the input's dtype, as cuDNN's batch norm
// gives it under autocast.
#include <algorithm>
#include <cmath>

#include "autograd/function.h"
#include "autograd/ops.h"
#include "tensor/operand_check.h"

namespace mpt {
namespace {

// (Run at every forward: the messages are made only for a failure.)
void check_batch_norm_args(const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                           const Tensor& weight, const Tensor& bias, bool training, double momentum, double eps) {
  check_floating("batch_norm", x);  // (defined, too)
  if (x.dim() < 2) throw ShapeError(fmt::format("batch_norm: input {} must be [N, C, ...]", describe(x)));
  const int64_t c = x.size(1);
  const std::pair<const Tensor*, const char*> per_channel[] = {
      {&running_mean, "running_mean"}, {&running_var, "running_var"}, {&weight, "weight"}, {&bias, "bias"}};
  for (const auto& [t, name] : per_channel) {
    if (!t->defined()) continue;
    if (t->shape() != Shape{c})
      throw ShapeError(fmt::format("batch_norm: {} {} does not match the {} channels of input {}", name,
                                   describe(*t), c, describe(x)));
    if (t->device() != x.device())
      throw DeviceError(fmt::format("batch_norm: {} {} is on {}, input {} on {}", name, describe(*t),
                                    t->device().str(), describe(x), x.device().str()));
    check_floating("batch_norm", *t);
  }
  check<ValueError>(running_mean.defined() == running_var.defined(),
                    "batch_norm: running_mean and running_var must be given together");
  check<ValueError>(training || running_mean.defined(),
                    "batch_norm: without training, the running statistics normalise, but none were given");
  check<ValueError>(std::isfinite(eps) && eps >= 0, "batch_norm: eps must be finite and >= 0, got {}", eps);
  check<ValueError>(std::isfinite(momentum) && momentum >= 0 && momentum <= 1,
                    "batch_norm: momentum must be in [0, 1], got {}", momentum);
  if (training && x.numel() / std::max<int64_t>(c, 1) <= 1)
    throw ShapeError(
        fmt::format("batch_norm: training needs more than one value per channel, got input {}", describe(x)));
}

// A [C] tensor as [1, C, 1, ...] in the compute dtype: it broadcasts over
// the input's other dimensions.
Tensor per_channel(const Tensor& t, DType compute, const Shape& channel_shape) {
  return prim::reshape(prim::to(t, compute), channel_shape);
}

Tensor fused_batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                        const Tensor& bias, bool training, double momentum, double eps) {
  const std::vector<Tensor> r = prim::batch_norm_forward(x, running_mean, running_var, weight, bias, training,
                                                         momentum, eps);
  Tensor out = r[0];
  if (needs_grad({x, weight, bias}))
    record("batch_norm", out, {x, weight, bias}, Saved{x, weight},
           [x, weight, bias, mean = r[1], rstd = r[2], training](const Grads& g) {
             const bool want_weight = weight.defined() && weight.requires_grad();
             const bool want_bias = bias.defined() && bias.requires_grad();
             const std::vector<Tensor> grads = prim::batch_norm_backward(
                 g[0], x, weight, mean, rstd, training, x.requires_grad(), want_weight, want_bias);
             return Grads{grads[0], grads[1], grads[2]};
           });
  return out;
}

}  // namespace

Tensor batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                  const Tensor& bias, bool training, double momentum, double eps) {
  check_batch_norm_args(x, running_mean, running_var, weight, bias, training, momentum, eps);
  if (prim::fused_batch_norm_available(x, running_mean, running_var, weight, bias))
    return fused_batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps);
  const DType ct = compute_dtype(x.dtype());
  const int64_t c = x.size(1);
  std::vector<int64_t> dims{0};  // every dimension but the channels'
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  Shape channel_shape(static_cast<size_t>(x.dim()), 1);  // [1, C, 1, ...]: broadcasts over the rest
  channel_shape[1] = c;

  const Tensor x_wide = prim::to(x, ct);
  Tensor centered, rstd;
  if (training) {
    const Tensor mean = prim::mean(x_wide, dims, true);
    centered = prim::sub(x_wide, mean);
    const Tensor var = prim::mean(prim::unary(UnaryOp::square, centered), dims, true);  // biased, as it normalises
    rstd = prim::unary(UnaryOp::rsqrt, prim::add_scalar(var, eps));
    if (running_mean.defined()) {
      // r = (1 - momentum) r + momentum * statistic; the variance unbiased.
      const double n = static_cast<double>(x.numel() / c);
      const auto blend = [&](const Tensor& r, const Tensor& statistic, double scale) {
        const Tensor s = prim::mul_scalar(prim::reshape(statistic, {c}), momentum * scale);
        prim::copy_(r, prim::add(prim::mul_scalar(prim::to(r, ct), 1.0 - momentum), s));
      };
      blend(running_mean, mean, 1.0);
      blend(running_var, var, n / (n - 1));
    }
  } else {
    centered = prim::sub(x_wide, per_channel(running_mean, ct, channel_shape));
    rstd = prim::unary(UnaryOp::rsqrt, prim::add_scalar(per_channel(running_var, ct, channel_shape), eps));
  }
  const Tensor xhat = prim::mul(centered, rstd);
  Tensor y = xhat;
  if (weight.defined()) y = prim::mul(y, per_channel(weight, ct, channel_shape));
  if (bias.defined()) y = prim::add(y, per_channel(bias, ct, channel_shape));
  Tensor out = prim::to(y, x.dtype());
  if (needs_grad({x, weight, bias}))
    // Only x's dtype: the rule reads xhat and rstd, so x itself need not stay alive.
    record("batch_norm", out, {x, weight, bias}, Saved{weight},
           [x_dtype = x.dtype(), weight, bias, xhat, rstd, dims, channel_shape, training](const Grads& g) {
             const Tensor gy = prim::to(g[0], xhat.dtype());
             Tensor gw, gb;
             if (weight.defined() && weight.requires_grad())
               gw = prim::to(prim::sum(prim::mul(gy, xhat), dims), weight.dtype());
             if (bias.defined() && bias.requires_grad()) gb = prim::to(prim::sum(gy, dims), bias.dtype());
             const Tensor gxhat =
                 weight.defined() ? prim::mul(gy, per_channel(weight, xhat.dtype(), channel_shape)) : gy;
             // With batch statistics the mean and variance depend on x too:
             // dx = rstd * (gxhat - mean(gxhat) - xhat * mean(gxhat * xhat)).
             // With running ones they are constants: dx = rstd * gxhat.
             Tensor inner = gxhat;
             if (training)
               inner = prim::sub(prim::sub(gxhat, prim::mean(gxhat, dims, true)),
                                 prim::mul(xhat, prim::mean(prim::mul(gxhat, xhat), dims, true)));
             return Grads{prim::to(prim::mul(inner, rstd), x_dtype), gw, gb};
           });
  return out;
}

}  // namespace mpt
