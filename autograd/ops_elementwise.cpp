// Element-wise ops and their backward rules.
#include "autograd/autocast_hook.h"
#include "autograd/function.h"
#include "autograd/grad_utils.h"
#include "autograd/ops.h"
#include "tensor/operand_check.h"

namespace mpt {

using prim::binary;
using prim::unary;

Tensor add(const Tensor& a, const Tensor& b) {
  if (AutocastOp ac{"add", {&a, &b}}) return add(ac[0], ac[1]);
  Tensor out = prim::add(a, b);
  if (needs_grad({a, b}))
    record("add", out, {a, b}, [a = meta_of(a), b = meta_of(b)](const Grads& g) {
      return Grads{grad_for(g[0], a), grad_for(g[0], b)};
    });
  return out;
}

Tensor sub(const Tensor& a, const Tensor& b) {
  if (AutocastOp ac{"sub", {&a, &b}}) return sub(ac[0], ac[1]);
  Tensor out = prim::sub(a, b);
  if (needs_grad({a, b}))
    record("sub", out, {a, b}, [a = meta_of(a), b = meta_of(b)](const Grads& g) {
      return Grads{grad_for(g[0], a), grad_for(prim::neg(g[0]), b)};
    });
  return out;
}

Tensor mul(const Tensor& a, const Tensor& b) {
  if (AutocastOp ac{"mul", {&a, &b}}) return mul(ac[0], ac[1]);
  Tensor out = prim::mul(a, b);
  if (needs_grad({a, b}))
    record("mul", out, {a, b}, Saved{a, b}, [a, b](const Grads& g) {
      return Grads{a.requires_grad() ? grad_for(prim::mul(g[0], b), meta_of(a)) : Tensor(),
                   b.requires_grad() ? grad_for(prim::mul(g[0], a), meta_of(b)) : Tensor()};
    });
  return out;
}

Tensor div(const Tensor& a, const Tensor& b) {
  if (AutocastOp ac{"div", {&a, &b}}) return div(ac[0], ac[1]);
  Tensor out = prim::div(a, b);
  if (needs_grad({a, b}))
    record("div", out, {a, b}, Saved{b, out}, [a = meta_of(a), b, out](const Grads& g) {
      const Tensor ga = prim::div(g[0], b);
      // d(a/b)/db = -(a/b)/b
      return Grads{grad_for(ga, a),
                   b.requires_grad() ? grad_for(prim::neg(prim::mul(ga, out)), meta_of(b)) : Tensor()};
    });
  return out;
}

Tensor add(const Tensor& a, double s) {
  Tensor out = prim::add_scalar(a, s);
  if (needs_grad({a})) record("add_scalar", out, {a}, [](const Grads& g) { return Grads{g[0]}; });
  return out;
}

Tensor mul(const Tensor& a, double s) {
  Tensor out = prim::mul_scalar(a, s);
  if (needs_grad({a})) record("mul_scalar", out, {a}, [s](const Grads& g) { return Grads{prim::mul_scalar(g[0], s)}; });
  return out;
}

Tensor neg(const Tensor& x) {
  Tensor out = prim::neg(x);
  if (needs_grad({x})) record("neg", out, {x}, [](const Grads& g) { return Grads{prim::neg(g[0])}; });
  return out;
}

Tensor pow(const Tensor& x, double p) {
  if (AutocastOp ac{"pow", {&x}}) return pow(ac[0], p);
  Tensor out = unary(UnaryOp::pow_scalar, x, p);
  if (needs_grad({x}))
    record("pow", out, {x}, Saved{x}, [x, p](const Grads& g) {
      // x^0 is constant: zero, also at x = 0 (where 0 * 0^-1 would be NaN), as in PyTorch.
      if (p == 0.0) return Grads{zeros(g[0].shape(), g[0].dtype(), g[0].device())};
      return Grads{prim::mul(g[0], unary(UnaryOp::affine, unary(UnaryOp::pow_scalar, x, p - 1), p, 0.0))};
    });
  return out;
}

Tensor pow(const Tensor& x, const Tensor& e) {
  if (AutocastOp ac{"pow", {&x, &e}}) return pow(ac[0], ac[1]);
  Tensor out = binary(BinaryOp::pow, x, e);
  if (needs_grad({x, e}))
    record("pow", out, {x, e}, Saved{x, e, out}, [x, e, out](const Grads& g) {
      // d/dx x^e = e x^(e-1);  d/de x^e = out * log(x). As in PyTorch, the
      // first is 0 where e = 0 (not 0 * 0^-1 = NaN at x = 0), the second 0
      // where x = 0 and e >= 0 (not 0 * log 0): there x^(e-1) becomes x^0
      // and log(x) log(1).
      Tensor gx, ge;
      if (x.requires_grad()) {
        const Tensor e_is_zero = binary(BinaryOp::eq, e, zeros({}, e.dtype(), e.device()));
        const Tensor power = prim::add(prim::add_scalar(e, -1.0), e_is_zero);
        gx = grad_for(prim::mul(g[0], prim::mul(e, binary(BinaryOp::pow, x, power))), meta_of(x));
      }
      if (e.requires_grad()) {
        const Tensor zero_base = prim::mul(binary(BinaryOp::eq, x, zeros({}, x.dtype(), x.device())),
                                           binary(BinaryOp::ge, e, zeros({}, e.dtype(), e.device())));
        ge = grad_for(prim::mul(g[0], prim::mul(out, unary(UnaryOp::log, prim::add(x, zero_base)))), meta_of(e));
      }
      return Grads{gx, ge};
    });
  return out;
}

Tensor exp(const Tensor& x) {
  if (AutocastOp ac{"exp", {&x}}) return exp(ac[0]);
  Tensor out = unary(UnaryOp::exp, x);
  if (needs_grad({x})) record("exp", out, {x}, Saved{out}, [out](const Grads& g) { return Grads{prim::mul(g[0], out)}; });
  return out;
}

Tensor log(const Tensor& x) {
  if (AutocastOp ac{"log", {&x}}) return log(ac[0]);
  Tensor out = unary(UnaryOp::log, x);
  if (needs_grad({x})) record("log", out, {x}, Saved{x}, [x](const Grads& g) { return Grads{prim::div(g[0], x)}; });
  return out;
}

Tensor sqrt(const Tensor& x) {
  Tensor out = unary(UnaryOp::sqrt, x);
  if (needs_grad({x}))
    record("sqrt", out, {x}, Saved{out}, [out](const Grads& g) {
      return Grads{prim::div(prim::mul_scalar(g[0], 0.5), out)};
    });
  return out;
}

Tensor tanh(const Tensor& x) {
  Tensor out = unary(UnaryOp::tanh, x);
  if (needs_grad({x}))
    record("tanh", out, {x}, Saved{out}, [out](const Grads& g) { return Grads{binary(BinaryOp::tanh_backward, g[0], out)}; });
  return out;
}

Tensor sigmoid(const Tensor& x) {
  Tensor out = unary(UnaryOp::sigmoid, x);
  if (needs_grad({x}))
    record("sigmoid", out, {x}, Saved{out},
           [out](const Grads& g) { return Grads{binary(BinaryOp::sigmoid_backward, g[0], out)}; });
  return out;
}

Tensor relu(const Tensor& x) {
  Tensor out = unary(UnaryOp::relu, x);
  if (needs_grad({x})) {
    // The output, not the input, is kept: out > 0 exactly where x > 0, and
    // the next layer keeps the output anyway, so the input can be freed.
    // (Detached: the node must not own its own output.)
    const Tensor kept = detach(out);
    record("relu", out, {x}, Saved{kept}, [kept](const Grads& g) { return Grads{binary(BinaryOp::relu_backward, g[0], kept)}; });
  }
  return out;
}

Tensor silu(const Tensor& x) {
  check_floating("silu", x);
  // In f32 (f64 for f64) and rounded once to x's dtype, the gradient too.
  const Tensor wide = to(x, compute_dtype(x.dtype()));
  return to(mul(wide, sigmoid(wide)), x.dtype());
}

Tensor gelu(const Tensor& x, GeluApprox approx) {
  const bool exact = approx == GeluApprox::none;
  Tensor out = unary(exact ? UnaryOp::gelu_erf : UnaryOp::gelu_tanh, x);
  if (needs_grad({x}))
    record("gelu", out, {x}, Saved{x}, [x, exact](const Grads& g) {
      return Grads{binary(exact ? BinaryOp::gelu_erf_backward : BinaryOp::gelu_tanh_backward, g[0], x)};
    });
  return out;
}

}  // namespace mpt
