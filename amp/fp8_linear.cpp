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
  const void* storage = weight.storage().get();
  if (s.weight_fp8.defined() && s.weight_storage == storage && s.weight_version == weight.version()) return;
  prim::Fp8Quantized q = s.scaling->quantize(Fp8Group::forward, s.weight_slot, weight, true);
  s.weight_fp8 = q.data;
  s.weight_fp8_t = q.data_t;
  s.weight_scale_inv = q.scale_inv;
  s.weight_storage = storage;
  s.weight_version = weight.version();
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

Tensor fp8_linear(const Tensor& x, const Tensor& weight, const Tensor& bias, Fp8LinearState& state, DType out_dtype,
                  bool relu) {
  const char* op = "fp8_linear";
  check_linear_operands(op, x, weight, bias);
  check<ValueError>(state.scaling != nullptr, "{}: the layer has no FP8 scaling state", op);
  check<DTypeError>(out_dtype == DType::bf16 || out_dtype == DType::f16, "{}: the output must be bf16 or f16, got {}",
                    op, dtype_name(out_dtype));
  const Tensor x2 = as_rows(x);
  const int64_t rows = x2.shape()[0], in = weight.shape()[1], out_features = weight.shape()[0];
  if (!prim::fp8_gemm_shape_ok(rows, out_features, in)) {
    if (!state.warned) {
      std::fputs(fmt::format("mptrain: warning: fp8_linear: input {} with weight {} runs in {}, not FP8 (FP8 "
                             "products need every size a multiple of 16)\n",
                             describe(x), describe(weight), dtype_name(out_dtype))
                     .c_str(),
                 stderr);
      state.warned = true;
    }
    const Tensor b = bias.defined() ? to(bias, out_dtype) : bias;
    return relu ? linear_relu(to(x, out_dtype), to(weight, out_dtype), b)
                : linear(to(x, out_dtype), to(weight, out_dtype), b);
  }
  const bool grad = needs_grad({x, weight, bias});
  refresh_weight(state, weight);
  const prim::Fp8Quantized xq = state.scaling->quantize(Fp8Group::forward, state.input_slot, x2, grad);
  const Tensor b = bias.defined() ? prim::to(bias, out_dtype) : Tensor();
  Shape out_shape = x.shape();
  out_shape.back() = out_features;
  Tensor out = prim::reshape(
      prim::gemm_fp8(xq.data, xq.scale_inv, state.weight_fp8, state.weight_scale_inv, b, out_dtype, true, relu),
      out_shape);
  if (grad) {
    // As relu() does: the output is kept (out > 0 exactly where the product
    // is), detached so that the node does not own its own output.
    const Tensor kept = relu ? prim::reshape(detach(out), {rows, out_features}) : Tensor();
    record(op, out, {x, weight, bias},
           [x, weight, bias, out_dtype, kept, scaling = state.scaling, grad_slot = state.grad_slot, x_t = xq.data_t,
            x_scale_inv = xq.scale_inv, w_t = state.weight_fp8_t, w_scale_inv = state.weight_scale_inv](const Grads& g) {
             const bool want_bias = bias.defined() && bias.requires_grad();
             const Tensor g2 = prim::contiguous(as_rows(g[0]));
             const prim::Fp8Quantized gq =
                 scaling->quantize(Fp8Group::backward, grad_slot, g2, weight.requires_grad(), kept, want_bias);
             Tensor gx, gw, gb;
             if (x.requires_grad())
               gx = prim::reshape(prim::to(prim::gemm_fp8(gq.data, gq.scale_inv, w_t, w_scale_inv, Tensor(), out_dtype,
                                                          false),
                                           x.dtype()),
                                  x.shape());
             if (weight.requires_grad())
               gw = prim::to(prim::gemm_fp8(gq.data_t, gq.scale_inv, x_t, x_scale_inv, Tensor(), DType::f32, false),
                             weight.dtype());
             if (want_bias) gb = prim::to(gq.column_sums, bias.dtype());
             return Grads{gx, gw, gb};
           });
  }
  return out;
}

}  // namespace mpt::amp
