#include "models/clip_grad.h"

#include <algorithm>
#include <cmath>

#include "autograd/grad_mode.h"
#include "tensor/ops.h"

namespace mpt::nn {

namespace {

void check_arguments(double max_norm, double norm_type) {
  check(max_norm >= 0, "clip_grad_norm_: max_norm must be >= 0, got {}", max_norm);
  check(norm_type > 0, "clip_grad_norm_: norm_type must be > 0 (or infinity), got {}", norm_type);
}

std::vector<Tensor> gradients_of(const std::vector<Tensor>& params) {
  std::vector<Tensor> grads;
  for (const Tensor& p : params)
    if (Tensor g = p.grad(); g.defined()) grads.push_back(g);
  return grads;
}

// sum |g|^p over every gradient (max |g| for the infinity norm), a 0-d
// tensor on the first gradient's device. In f32, or in f64 when a gradient
// is f64: an f64 gradient's norm is f64 in PyTorch too, and in f32 a
// component of 1e20 would square to infinity.
Tensor norm_accumulator(const std::vector<Tensor>& grads, double norm_type) {
  const bool inf_norm = std::isinf(norm_type);
  const Device& device = grads.front().device();
  const bool any_f64 =
      std::any_of(grads.begin(), grads.end(), [](const Tensor& g) { return g.dtype() == DType::f64; });
  const DType acc_dtype = any_f64 ? DType::f64 : DType::f32;
  Tensor acc = scalar_tensor(0.0, acc_dtype, device);
  for (const Tensor& g : grads) {
    if (g.numel() == 0) continue;
    const Tensor a = prim::unary(UnaryOp::abs, prim::to(g, acc_dtype));
    Tensor part;
    if (inf_norm) {
      part = prim::amax(a);
    } else if (norm_type == 2.0) {
      part = prim::sum(prim::unary(UnaryOp::square, a));
    } else {
      part = prim::sum(prim::unary(UnaryOp::pow_scalar, a, norm_type));
    }
    prim::binary_(inf_norm ? BinaryOp::maximum : BinaryOp::add, acc, acc, prim::to(part, device));
  }
  return acc;
}

}  // namespace

double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type) {
  check_arguments(max_norm, norm_type);
  NoGradGuard no_grad;
  const std::vector<Tensor> grads = gradients_of(params);
  if (grads.empty()) return 0.0;
  // Each gradient's partial result is combined on the first gradient's
  // device, so the only host sync is this item().
  double total = norm_accumulator(grads, norm_type).item();
  if (!std::isinf(norm_type)) total = std::pow(total, 1.0 / norm_type);

  // A NaN coefficient is kept (torch.clamp keeps NaN), not clamped to 1.
  const double coef = max_norm / (total + 1e-6);
  const double scale = coef < 1.0 ? coef : (std::isnan(coef) ? coef : 1.0);
  if (scale != 1.0) {
    for (const Tensor& g : grads) prim::unary_(UnaryOp::affine, g, g, scale, 0.0);
  }
  return total;
}

Tensor clip_grad_norm_on_device_(const std::vector<Tensor>& params, double max_norm, double norm_type) {
  check_arguments(max_norm, norm_type);
  NoGradGuard no_grad;
  const std::vector<Tensor> grads = gradients_of(params);
  if (grads.empty()) return Tensor();
  Tensor total = norm_accumulator(grads, norm_type);
  if (!std::isinf(norm_type)) total = prim::unary(UnaryOp::pow_scalar, total, 1.0 / norm_type);
  // min(1, max_norm / (total + 1e-6)); minimum keeps a NaN, as torch.clamp does.
  const Tensor coef = prim::mul_scalar(prim::unary(UnaryOp::reciprocal, prim::add_scalar(total, 1e-6)), max_norm);
  const Tensor clamped = prim::binary(BinaryOp::minimum, coef, scalar_tensor(1.0, coef.dtype(), coef.device()));
  for (const Tensor& g : grads) prim::binary_(BinaryOp::mul, g, g, prim::to(clamped, g.dtype()));
  return total;
}

}  // namespace mpt::nn
