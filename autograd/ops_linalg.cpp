// Reductions and matrix products with their backward rules.
#include "autograd/autocast_hook.h"
#include "autograd/function.h"
#include "autograd/grad_utils.h"
#include "autograd/ops.h"

namespace mpt {
namespace {

// Shape of the reduced result with the reduced dimensions kept as 1.
Shape kept_shape(const Shape& shape, const std::vector<int64_t>& dims) {
  Shape s = shape;
  if (dims.empty()) return Shape(s.size(), 1);
  for (int64_t d : dims) s[normalize_dim(d, static_cast<int64_t>(shape.size()), "sum")] = 1;
  return s;
}

// Gradient of a reduction: broadcast back over the reduced dimensions.
Tensor spread(const Tensor& g, const Shape& x_shape, const std::vector<int64_t>& dims, double scale) {
  Tensor k = prim::reshape(g, kept_shape(x_shape, dims));
  if (scale != 1.0) k = prim::mul_scalar(k, scale);
  return prim::contiguous(prim::expand(k, x_shape));
}

}  // namespace

Tensor sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  if (AutocastOp ac{"sum", {&x}}) return sum(ac[0], dims, keepdim);
  Tensor out = prim::sum(x, dims, keepdim);
  if (needs_grad({x})) record("sum", out, {x}, [shape = x.shape(), dims](const Grads& g) { return Grads{spread(g[0], shape, dims, 1.0)}; });
  return out;
}

Tensor mean(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  if (AutocastOp ac{"mean", {&x}}) return mean(ac[0], dims, keepdim);
  Tensor out = prim::mean(x, dims, keepdim);
  if (needs_grad({x})) {
    const double count = static_cast<double>(x.numel()) / static_cast<double>(std::max<int64_t>(out.numel(), 1));
    record("mean", out, {x}, [shape = x.shape(), dims, count](const Grads& g) {
      return Grads{spread(g[0], shape, dims, 1.0 / count)};
    });
  }
  return out;
}

Tensor matmul(const Tensor& a, const Tensor& b) {
  if (AutocastOp ac{"matmul", {&a, &b}}) return matmul(ac[0], ac[1]);
  Tensor out = prim::matmul(a, b);
  if (needs_grad({a, b}))
    record("matmul", out, {a, b}, [a, b](const Grads& g) {
      Tensor ga, gb;
      if (a.requires_grad()) ga = sum_to(prim::matmul(g[0], prim::transpose(b, -1, -2)), a.shape());
      if (b.requires_grad()) {
        if (b.dim() == 2 && a.dim() > 2) {
          // [..., m, k] @ [k, n]: fold the batch into rows, one GEMM.
          const int64_t k = a.shape().back(), n = b.shape().back();
          gb = prim::matmul(prim::transpose(prim::reshape(a, {-1, k}), 0, 1), prim::reshape(g[0], {-1, n}));
        } else {
          gb = sum_to(prim::matmul(prim::transpose(a, -1, -2), g[0]), b.shape());
        }
      }
      return Grads{ga, gb};
    });
  return out;
}

Tensor bmm(const Tensor& a, const Tensor& b) {
  if (AutocastOp ac{"bmm", {&a, &b}}) return bmm(ac[0], ac[1]);
  check<ShapeError>(a.dim() == 3 && b.dim() == 3 && a.shape()[0] == b.shape()[0],
                    "bmm: expects [B, m, k] and [B, k, n], got {} and {}", describe(a), describe(b));
  return matmul(a, b);
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  if (AutocastOp ac{"linear", {&x, &weight, &bias}}) return linear(ac[0], ac[1], ac[2]);
  check<ShapeError>(weight.dim() == 2 && x.dim() >= 1 && x.shape().back() == weight.shape()[1],
                    "linear: input {} does not match weight {} (expected [..., {}])", describe(x), describe(weight),
                    weight.dim() == 2 ? weight.shape()[1] : -1);
  check<ShapeError>(!bias.defined() || (bias.dim() == 1 && bias.shape()[0] == weight.shape()[0]),
                    "linear: bias {} does not match weight {}", describe(bias), describe(weight));
  const int64_t in = weight.shape()[1], out_features = weight.shape()[0];
  Shape out_shape = x.shape();
  out_shape.back() = out_features;
  const Tensor x2 = prim::reshape(x, {-1, in});
  // The bias rides in the GEMM's epilogue (prim::linear), and in backward
  // the bias gradient in the weight gradient's (prim::linear_weight_grad).
  Tensor out = prim::reshape(prim::linear(x2, weight, bias), out_shape);
  if (needs_grad({x, weight, bias}))
    record("linear", out, {x, weight, bias}, [x2, x, weight, bias, out_features](const Grads& g) {
      const Tensor g2 = prim::contiguous(prim::reshape(g[0], {-1, out_features}));
      const bool want_bias = bias.defined() && bias.requires_grad();
      Tensor gx, gw, gb;
      if (x.requires_grad()) gx = prim::reshape(prim::matmul(g2, weight), x.shape());
      if (weight.requires_grad()) {
        std::tie(gw, gb) = prim::linear_weight_grad(g2, x2, want_bias);
      } else if (want_bias) {
        gb = prim::sum(g2, {0});
      }
      return Grads{gx, gw.defined() ? prim::to(gw, weight.dtype()) : gw, gb.defined() ? prim::to(gb, bias.dtype()) : gb};
    });
  return out;
}

}  // namespace mpt
