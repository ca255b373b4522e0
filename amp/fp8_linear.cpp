#include "amp/fp8_linear.h"

#include <cstdio>

#include "autograd/function.h"
#include "autograd/grad_mode.h"
#include "autograd/grad_utils.h"
#include "autograd/ops.h"
#include "tensor/operand_check.h"

namespace mpt::amp {
namespace {

thread_local bool t_fp8_enabled = false;

// The weight's FP8 copies, made again only when the weight has changed.
void refresh_weight(Fp8LinearState& s, const Tensor& weight) {
  if (s.copies_are_of(weight)) return;
  prim::Fp8Quantized q = s.scaling->quantize(Fp8Group::forward, s.weight_slot, weight, true);
  s.weight_fp8 = q.data;
  s.weight_fp8_t = q.data_t;
  s.weight_scale_inv = q.scale_inv;
  s.copies_made_from(weight);
}

}  // namespace

bool fp8_enabled() { return t_fp8_enabled; }
Fp8Guard::Fp8Guard(bool enabled) : previous_(t_fp8_enabled) { t_fp8_enabled = enabled; }
Fp8Guard::~Fp8Guard() { t_fp8_enabled = previous_; }

Fp8LinearState Fp8LinearState::for_layer(std::shared_ptr<Fp8Scaling> scaling, const std::string& name) {
  Fp8LinearState s;
  s.input_slot = scaling->add_slots(Fp8Group::forward, {name + ".input", name + ".weight"});
  s.weight_slot = s.input_slot + 1;
  s.grad_slot = scaling->add_slots(Fp8Group::backward, {name + ".grad_output"});
  s.scaling = std::move(scaling);
  return s;
}

namespace {

void check_out_dtype(const char* op, DType out_dtype) {
  check<DTypeError>(out_dtype == DType::bf16 || out_dtype == DType::f16, "{}: the output must be bf16 or f16, got {}",
                    op, dtype_name(out_dtype));
}

// The forward product of a layer whose input is quantized (its weight's
// copies refreshed): [rows, out] in out_dtype, the bias added (and a ReLU)
// in the GEMM's epilogue.
Tensor forward_product(const prim::Fp8Quantized& xq, const Fp8LinearState& s, const Tensor& bias, DType out_dtype,
                       bool relu) {
  const Tensor b = bias.defined() ? prim::to(bias, out_dtype) : Tensor();
  return prim::gemm_fp8(xq.data, xq.scale_inv, s.weight_fp8, s.weight_scale_inv, b, out_dtype,
                        s.scaling->recipe().forward_fast_accumulation, relu);
}

bool wants_bias_grad(const Tensor& bias) { return bias.defined() && bias.requires_grad(); }

// What a layer's backward reads of its forward: the input's and the
// weight's transposed copies, and 1 / their scales.
struct SavedOperands {
  Tensor x_t, x_scale_inv, w_t, w_scale_inv;
  SavedOperands(const prim::Fp8Quantized& xq, const Fp8LinearState& s)
      : x_t(xq.data_t), x_scale_inv(xq.scale_inv), w_t(s.weight_fp8_t), w_scale_inv(s.weight_scale_inv) {}
};

// A layer's three backward products from its quantized output gradient gq:
// the input's gradient [rows, in] in out_dtype (where want_x), the
// weight's in its dtype, the bias's (gq's column sums) in its dtype.
struct LayerGrads {
  Tensor x, weight, bias;
};
LayerGrads backward_products(const prim::Fp8Quantized& gq, const SavedOperands& saved, bool want_x,
                             const Tensor& weight, const Tensor& bias, DType out_dtype) {
  LayerGrads g;
  if (want_x) g.x = prim::gemm_fp8(gq.data, gq.scale_inv, saved.w_t, saved.w_scale_inv, Tensor(), out_dtype, false);
  if (weight.requires_grad())
    g.weight = prim::to(prim::gemm_fp8(gq.data_t, gq.scale_inv, saved.x_t, saved.x_scale_inv, Tensor(), DType::f32,
                                       false),
                        weight.dtype());
  if (wants_bias_grad(bias)) g.bias = prim::to(gq.column_sums, bias.dtype());
  return g;
}

// Said once per layer: a shape FP8 products cannot take runs in 16 bits.
void warn_not_fp8(Fp8LinearState& state, const char* op, const Tensor& x, const Tensor& weight, DType out_dtype) {
  if (state.warned) return;
  std::fputs(fmt::format("mptrain: warning: {}: input {} with weight {} runs in {}, not FP8 (FP8 products need "
                         "every size a multiple of 16)\n",
                         op, describe(x), describe(weight), dtype_name(out_dtype))
                 .c_str(),
             stderr);
  state.warned = true;
}

Fp8Prologue gelu_prologue(GeluApprox approx) {
  return approx == GeluApprox::none ? Fp8Prologue::gelu_erf : Fp8Prologue::gelu_tanh;
}

Fp8Prologue gelu_backward_prologue(GeluApprox approx) {
  return approx == GeluApprox::none ? Fp8Prologue::gelu_erf_backward : Fp8Prologue::gelu_tanh_backward;
}

}  // namespace

Tensor fp8_linear(const Tensor& x, const Tensor& weight, const Tensor& bias, Fp8LinearState& state, DType out_dtype,
                  bool relu) {
  const char* op = "fp8_linear";
  check_linear_operands(op, x, weight, bias);
  check<ValueError>(state.scaling != nullptr, "{}: the layer has no FP8 scaling state", op);
  check_out_dtype(op, out_dtype);
  const Tensor x2 = as_rows(x);
  const int64_t rows = x2.shape()[0], in = weight.shape()[1], out_features = weight.shape()[0];
  if (!prim::fp8_gemm_shape_ok(rows, out_features, in)) {
    warn_not_fp8(state, op, x, weight, out_dtype);
    const Tensor b = bias.defined() ? to(bias, out_dtype) : bias;
    return relu ? linear_relu(to(x, out_dtype), to(weight, out_dtype), b)
                : linear(to(x, out_dtype), to(weight, out_dtype), b);
  }
  const bool grad = needs_grad({x, weight, bias});
  refresh_weight(state, weight);
  const prim::Fp8Quantized xq = state.scaling->quantize(Fp8Group::forward, state.input_slot, x2, grad);
  Shape out_shape = x.shape();
  out_shape.back() = out_features;
  Tensor out = prim::reshape(forward_product(xq, state, bias, out_dtype, relu), out_shape);
  if (grad) {
    // As relu() does: the output is kept (out > 0 exactly where the product
    // is), detached so that the node does not own its own output; its
    // backward is the prologue of the gradient's quantization.
    const Tensor kept = relu ? prim::reshape(detach(out), {rows, out_features}) : Tensor();
    record(op, out, {x, weight, bias},
           [x, weight, bias, out_dtype, kept, scaling = state.scaling, grad_slot = state.grad_slot,
            saved = SavedOperands(xq, state)](const Grads& g) {
             const prim::Fp8Quantized gq = scaling->quantize(
                 Fp8Group::backward, grad_slot, prim::contiguous(as_rows(g[0])), weight.requires_grad(),
                 kept.defined() ? Fp8Prologue::relu_backward : Fp8Prologue::none, kept, wants_bias_grad(bias));
             LayerGrads d = backward_products(gq, saved, x.requires_grad(), weight, bias, out_dtype);
             if (d.x.defined()) d.x = prim::reshape(prim::to(d.x, x.dtype()), x.shape());
             return Grads{d.x, d.weight, d.bias};
           });
  }
  return out;
}

Tensor fp8_mlp(const Tensor& x, const Fp8LayerOperands& fc, const Fp8LayerOperands& out, GeluApprox approx,
               DType out_dtype) {
  const char* op = "fp8_mlp";
  check_linear_operands(op, x, fc.weight, fc.bias);
  check<ShapeError>(out.weight.dim() == 2 && out.weight.shape()[1] == fc.weight.shape()[0],
                    "{}: the second layer's weight {} must take the first's {} outputs", op, describe(out.weight),
                    fc.weight.shape()[0]);
  check<ValueError>(fc.state != nullptr && fc.state->scaling != nullptr && out.state != nullptr &&
                        out.state->scaling != nullptr,
                    "{}: both layers need FP8 scaling state", op);
  check_out_dtype(op, out_dtype);
  const Tensor x2 = as_rows(x);
  const int64_t rows = x2.shape()[0], in = fc.weight.shape()[1], hidden = fc.weight.shape()[0],
                out_features = out.weight.shape()[0];
  if (!prim::fp8_gemm_shape_ok(rows, hidden, in) || !prim::fp8_gemm_shape_ok(rows, out_features, hidden)) {
    // Each layer on its own, where fp8_linear says which one runs in 16 bits.
    const Tensor h = fp8_linear(x, fc.weight, fc.bias, *fc.state, out_dtype);
    return fp8_linear(gelu(h, approx), out.weight, out.bias, *out.state, out_dtype);
  }
  Fp8LinearState& s1 = *fc.state;
  Fp8LinearState& s2 = *out.state;
  const bool grad = needs_grad({x, fc.weight, fc.bias, out.weight, out.bias});
  refresh_weight(s1, fc.weight);
  refresh_weight(s2, out.weight);
  const prim::Fp8Quantized xq = s1.scaling->quantize(Fp8Group::forward, s1.input_slot, x2, grad);
  const Tensor h = forward_product(xq, s1, fc.bias, out_dtype, false);
  const prim::Fp8Quantized gq = s2.scaling->quantize(Fp8Group::forward, s2.input_slot, h, grad, gelu_prologue(approx));
  Shape out_shape = x.shape();
  out_shape.back() = out_features;
  Tensor y = prim::reshape(forward_product(gq, s2, out.bias, out_dtype, false), out_shape);
  if (grad) {
    record(op, y, {x, fc.weight, fc.bias, out.weight, out.bias},
           [x, w1 = fc.weight, b1 = fc.bias, w2 = out.weight, b2 = out.bias, out_dtype, h, approx,
            scaling1 = s1.scaling, slot1 = s1.grad_slot, saved1 = SavedOperands(xq, s1), scaling2 = s2.scaling,
            slot2 = s2.grad_slot, saved2 = SavedOperands(gq, s2)](const Grads& g) {
             const prim::Fp8Quantized dyq =
                 scaling2->quantize(Fp8Group::backward, slot2, prim::contiguous(as_rows(g[0])), w2.requires_grad(),
                                    Fp8Prologue::none, Tensor(), wants_bias_grad(b2));
             const bool below = x.requires_grad() || w1.requires_grad() || wants_bias_grad(b1);
             const LayerGrads d2 = backward_products(dyq, saved2, below, w2, b2, out_dtype);
             LayerGrads d1;
             if (below) {
               // GELU's backward is the prologue of the first layer's output
               // gradient: dh = d(gelu(h)) * gelu'(h), never stored.
               const prim::Fp8Quantized dhq =
                   scaling1->quantize(Fp8Group::backward, slot1, d2.x, w1.requires_grad(),
                                      gelu_backward_prologue(approx), h, wants_bias_grad(b1));
               d1 = backward_products(dhq, saved1, x.requires_grad(), w1, b1, out_dtype);
               if (d1.x.defined()) d1.x = prim::reshape(prim::to(d1.x, x.dtype()), x.shape());
             }
             return Grads{d1.x, d1.weight, d1.bias, d2.weight, d2.bias};
           });
  }
  return y;
}

}  // namespace mpt::amp
