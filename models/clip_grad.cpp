#include "models/clip_grad.h"

#include <algorithm>
#include <cmath>

#include "autograd/grad_mode.h"
#include "tensor/ops.h"

namespace mpt::nn {

double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type) {
  check(max_norm >= 0, "clip_grad_norm_: max_norm must be >= 0, got {}", max_norm);
  check(norm_type > 0, "clip_grad_norm_: norm_type must be > 0 (or infinity), got {}", norm_type);
  NoGradGuard no_grad;
  std::vector<Tensor> grads;
  for (const Tensor& p : params)
    if (Tensor g = p.grad(); g.defined()) grads.push_back(g);
  if (grads.empty()) return 0.0;

  const bool inf_norm = std::isinf(norm_type);
  // Each gradient's partial result (sum |g|^p, or max |g|) is combined on
  // the first gradient's device, so the only host sync is the final item().
  // In f32, or in f64 when a gradient is f64: an f64 gradient's norm is
  // f64 in PyTorch too, and in f32 a component of 1e20 would square to
  // infinity.
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
  double total = acc.item();
  if (!inf_norm) total = std::pow(total, 1.0 / norm_type);

  // A NaN coefficient is kept (torch.clamp keeps NaN), not clamped to 1.
  const double coef = max_norm / (total + 1e-6);
  const double scale = coef < 1.0 ? coef : (std::isnan(coef) ? coef : 1.0);
  if (scale != 1.0) {
    for (const Tensor& g : grads) prim::unary_(UnaryOp::affine, g, g, scale, 0.0);
  }
  return total;
}

}  // namespace mpt::nn
