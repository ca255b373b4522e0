// Reductions and matrix products with their backward rules.
#include "autograd/autocast_hook.h"
#include "autograd/beside.h"
#include "autograd/function.h"
#include "autograd/grad_utils.h"
#include "autograd/ops.h"
#include "tensor/operand_check.h"

namespace mpt {
namespace {

// Shape of the reduced result with the reduced dimensions kept as 1.
Shape kept_shape(const Shape& shape, const std::vector<int64_t>& dims) {
  Shape s = shape;
  if (dims.empty() || s.empty()) return Shape(s.size(), 1);  // a 0-d input: dims 0 and -1 name the whole
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
    record("matmul", out, {a, b}, Saved{a, b}, [a, b](const Grads& g) {
      Tensor ga, gb;
      if (a.requires_grad()) ga = sum_to(prim::matmul(g[0], prim::transpose(b, -1, -2)), a.shape());
      if (b.requires_grad()) {
        if (b.dim() == 2 && a.dim() > 2) {
          // [..., m, k] @ [k, n]: fold the batch into rows, one GEMM.
          gb = prim::matmul(prim::transpose(as_rows(a), 0, 1), as_rows(g[0]));
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

namespace {

// The checks and the product of linear() and linear_relu(); `op` names the
// caller in errors.
Tensor linear_forward(const char* op, const Tensor& x, const Tensor& weight, const Tensor& bias, bool relu) {
  check_linear_operands(op, x, weight, bias);
  Shape out_shape = x.shape();
  out_shape.back() = weight.shape()[0];
  // The bias rides in the GEMM's epilogue (prim::linear), and in backward
  // the bias gradient in the weight gradient's (prim::linear_weight_grad).
  return prim::reshape(prim::linear(as_rows(x), weight, bias, relu), out_shape);
}

// Weight gradients of at least this many multiply-adds run beside the
// chain of input gradients. Below it the fork and join cost more than the
// overlap gives (the reference workloads' steps, measured both ways, in
// docs/PERFORMANCE.md).
constexpr double kBesideMinMultiplyAdds = 1e9;

// linear()'s backward from the gradient of its output (before any ReLU).
// The weight's and bias's gradients are off the chain of input gradients:
// large ones run beside it (beside.h), issued first so they start as soon
// as their inputs are ready.
Grads linear_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& bias) {
  const int64_t in = weight.shape()[1], out_features = weight.shape()[0];
  const Tensor g2 = prim::contiguous(as_rows(grad_out));
  const bool want_bias = bias.defined() && bias.requires_grad();
  Tensor gx, gw, gb;
  if (weight.requires_grad()) {
    const Tensor x2 = as_rows(x);
    auto weight_grads = [&] {
      auto [w, b] = prim::linear_weight_grad(g2, x2, want_bias);
      return std::vector<Tensor>{prim::to(w, weight.dtype()), b.defined() ? prim::to(b, bias.dtype()) : b};
    };
    const double multiply_adds = static_cast<double>(g2.shape()[0]) * static_cast<double>(out_features * in);
    const std::vector<Tensor> made =
        multiply_adds >= kBesideMinMultiplyAdds ? beside::run(x.device(), {g2, x2}, weight_grads) : weight_grads();
    gw = made[0];
    gb = made[1];
  } else if (want_bias) {
    gb = prim::to(prim::sum(g2, {0}), bias.dtype());
  }
  if (x.requires_grad()) gx = prim::reshape(prim::matmul(g2, weight), x.shape());
  return Grads{gx, gw, gb};
}

}  // namespace

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  if (AutocastOp ac{"linear", {&x, &weight, &bias}}) return linear(ac[0], ac[1], ac[2]);
  Tensor out = linear_forward("linear", x, weight, bias, false);
  if (needs_grad({x, weight, bias}))
    record("linear", out, {x, weight, bias}, Saved{x, weight},
           [x, weight, bias](const Grads& g) { return linear_backward(g[0], x, weight, bias); });
  return out;
}

Tensor linear_relu(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  if (AutocastOp ac{"linear_relu", {&x, &weight, &bias}}) return linear_relu(ac[0], ac[1], ac[2]);
  Tensor out = linear_forward("linear_relu", x, weight, bias, true);
  if (needs_grad({x, weight, bias})) {
    // As relu() does: the output is kept (out > 0 exactly where the product
    // is), detached so that the node does not own its own output.
    const Tensor kept = detach(out);
    record("linear_relu", out, {x, weight, bias}, Saved{x, weight, kept}, [x, weight, bias, kept](const Grads& g) {
      return linear_backward(prim::binary(BinaryOp::relu_backward, g[0], kept), x, weight, bias);
    });
  }
  return out;
}

}  // namespace mpt
