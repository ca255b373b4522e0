#include "models/adamw.h"

#include <cmath>
#include <cstdint>
#include <utility>

#include "amp/fp8_linear.h"
#include "models/fused_optim.h"
#include "tensor/device_guard.h"
#include "tensor/ops.h"

namespace mpt::optim {
namespace {

const AdamWOptions& validated(const AdamWOptions& o) {
  check(o.beta1 >= 0 && o.beta1 < 1, "AdamW: invalid beta1 {} (must be in [0, 1))", o.beta1);
  check(o.beta2 >= 0 && o.beta2 < 1, "AdamW: invalid beta2 {} (must be in [0, 1))", o.beta2);
  check(std::isfinite(o.eps) && o.eps >= 0, "AdamW: invalid eps {} (must be >= 0)", o.eps);
  return o;
}

// Where adamw_quantized() writes `layer`'s copies of `param`, checked:
// the copies' shapes are the weight's and its transpose, every operand is
// 16-byte aligned, and the rows fit its grid.
fused::QuantizedCopyTarget fp8_copy_target(const amp::Fp8LinearState& layer, const Tensor& param,
                                           const fused::AdamWTensor& t) {
  amp::Fp8Scaling& scaling = *layer.scaling;
  const int64_t rows = param.shape()[0], cols = param.shape()[1];
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  check(layer.weight_fp8.shape() == Shape{rows, cols} && layer.weight_fp8_t.shape() == Shape{cols, rows} &&
            aligned(t.param) && aligned(t.grad) && aligned(t.exp_avg) && aligned(t.exp_avg_sq) &&
            aligned(layer.weight_fp8.data_ptr()) && aligned(layer.weight_fp8_t.data_ptr()) && rows / 64 < 65535,
        "AdamW: the FP8 copies of {} are {} and {} (the sizes' transposes, every operand 16-byte aligned)",
        describe(param), describe(layer.weight_fp8), describe(layer.weight_fp8_t));
  return {layer.weight_fp8.data_ptr(),
          layer.weight_fp8_t.data_ptr(),
          static_cast<const float*>(scaling.scale(amp::Fp8Group::forward).data_ptr()) + layer.weight_slot,
          static_cast<float*>(layer.weight_scale_inv.data_ptr()),
          static_cast<float*>(scaling.amax(amp::Fp8Group::forward).data_ptr()) + layer.weight_slot,
          rows,
          cols,
          amp::fp8_format(amp::Fp8Group::forward) == DType::e5m2};
}

}  // namespace

AdamW::AdamW(std::vector<Tensor> params, const AdamWOptions& options)
    : AdamW(std::vector<ParamGroup>{ParamGroup{std::move(params), std::nullopt, std::nullopt}}, options) {}

AdamW::AdamW(std::vector<ParamGroup> groups, const AdamWOptions& options)
    : Optimizer("AdamW", std::move(groups), options.lr, options.weight_decay), options_(validated(options)) {}

void AdamW::update_group(const Group& group, std::vector<ParamUpdate>& batch) {
  fp8_written_.clear();  // after_update() stamps what this call writes
  const double b1 = options_.beta1, b2 = options_.beta2;
  for (ParamUpdate& u : batch) {
    OrderedDict<Tensor>& s = u.state->buffers;
    if (!s.contains("exp_avg")) {
      s.insert("exp_avg", zeros(u.param.shape(), u.param.dtype(), u.param.device()));
      s.insert("exp_avg_sq", zeros(u.param.shape(), u.param.dtype(), u.param.device()));
    }
  }
  // Bias corrections in double on the host; t is each parameter's own count,
  // so a parameter that skipped steps is corrected for its own history.
  auto bias_corrections = [&](const ParamUpdate& u) {
    const double t = static_cast<double>(u.state->step);
    return std::pair{1.0 - std::pow(b1, t), std::sqrt(1.0 - std::pow(b2, t))};
  };

  if (can_fuse(batch)) {
    // Capturable mode: counts and the skip decision on the device.
    const bool device_steps = capturable();
    std::vector<fused::AdamWTensor> tensors;
    std::vector<float*> steps;
    for (const ParamUpdate& u : batch) {
      const OrderedDict<Tensor>& s = u.state->buffers;
      fused::AdamWTensor t{u.param.data_ptr(), u.grad.data_ptr(), s.at("exp_avg").data_ptr(),
                           s.at("exp_avg_sq").data_ptr(), u.param.numel(), 0.0f, 0.0f};
      if (device_steps) {
        t.step = u.state->device_step.data<float>();
        steps.push_back(u.state->device_step.data<float>());
      } else {
        const auto [bc1, bc2_sqrt] = bias_corrections(u);
        t.step_size = static_cast<float>(group.lr / bc1);
        t.inv_bc2_sqrt = static_cast<float>(1.0 / bc2_sqrt);
      }
      tensors.push_back(t);
    }
    fused::AdamWScalars scalars{static_cast<float>(1.0 - group.lr * group.weight_decay),
                                static_cast<float>(b1),
                                static_cast<float>(b2),
                                static_cast<float>(options_.eps),
                                static_cast<float>(1.0 - b1),
                                static_cast<float>(1.0 - b2)};
    if (device_steps) {
      scalars.hyper = group.hyper_on_device.data<float>();
      scalars.correction_beta1 = b1;
      scalars.correction_beta2 = b2;
    }
    if (found_inf().defined()) scalars.found_inf = found_inf().data<float>();
    const Device device = batch.front().param.device();
    if (device.is_cpu()) {
      fused::adamw_on_host(batch.front().param.dtype(), tensors, scalars);
      return;
    }
    DeviceGuard guard(device);
    // Weights whose FP8 copies this step writes take a launch each; their
    // targets are all checked before anything is launched.
    std::vector<fused::AdamWTensor> plain;
    std::vector<std::pair<size_t, fused::QuantizedCopyTarget>> quantized;
    for (size_t i = 0; i < batch.size(); ++i) {
      const auto it = fp8_copies_.find(batch[i].param.impl_ptr().get());
      if (it == fp8_copies_.end()) plain.push_back(tensors[i]);
      else quantized.emplace_back(i, fp8_copy_target(*it->second, batch[i].param, tensors[i]));
    }
    for (const auto& [i, target] : quantized) {
      fused::adamw_quantized(tensors[i], target, scalars);
      fp8_written_.insert(batch[i].param.impl_ptr().get());
    }
    if (!plain.empty()) fused::adamw(batch.front().param.dtype(), plain, scalars);
    if (device_steps) fused::advance_steps(steps, scalars.found_inf);
    return;
  }
  check(!capturable(), "AdamW: capturable mode needs the fused kernel, but this group cannot use it");

  for (ParamUpdate& u : batch) {
    // The rule runs in f32 (f64 for f64) and each stored tensor is rounded
    // once at the end, as the fused kernels do: in 16 bits g * g alone
    // overflows f16 from |g| = 256, which would leave exp_avg_sq infinite
    // and the parameter stuck for good (PyTorch's addcmul_ widens too).
    const DType wide = compute_dtype(u.param.dtype());
    const Tensor& m_stored = u.state->buffers.at("exp_avg");
    const Tensor& v_stored = u.state->buffers.at("exp_avg_sq");
    const Tensor p = prim::to(u.param, wide), g = prim::to(u.grad, wide);
    const Tensor m = prim::to(m_stored, wide), v = prim::to(v_stored, wide);
    // Decoupled decay: shrink the weights, independent of the gradient.
    if (group.weight_decay != 0) prim::unary_(UnaryOp::affine, p, p, 1.0 - group.lr * group.weight_decay, 0.0);
    prim::unary_(UnaryOp::affine, m, m, b1, 0.0);
    prim::binary_(BinaryOp::add, m, m, prim::mul_scalar(g, 1.0 - b1));
    prim::unary_(UnaryOp::affine, v, v, b2, 0.0);
    prim::binary_(BinaryOp::add, v, v, prim::mul_scalar(prim::unary(UnaryOp::square, g), 1.0 - b2));
    const auto [bc1, bc2_sqrt] = bias_corrections(u);
    // denom = sqrt(v) / sqrt(bc2) + eps, in one affine after the sqrt.
    Tensor denom = prim::unary(UnaryOp::sqrt, v);
    prim::unary_(UnaryOp::affine, denom, denom, 1.0 / bc2_sqrt, options_.eps);
    Tensor update = prim::div(m, denom);
    prim::unary_(UnaryOp::affine, update, update, -group.lr / bc1, 0.0);
    prim::binary_(BinaryOp::add, p, p, update);
    // Back into the stored dtype (nothing to do where it was `wide` already).
    for (const auto& [stored, computed] : {std::pair{u.param, p}, {m_stored, m}, {v_stored, v}})
      if (!stored.is_same(computed)) prim::copy_(stored, computed);
  }
}

bool AdamW::write_fp8_copies(const Tensor& param, std::shared_ptr<amp::Fp8LinearState> layer) {
  const bool weight_fits = param.defined() && param.device().is_cuda() && param.dtype() == DType::f32 &&
                           param.dim() == 2 && param.is_contiguous() && param.shape()[0] % 16 == 0 &&
                           param.shape()[1] % 16 == 0;
  const bool layer_fits = layer && layer->scaling && layer->scaling->recipe().scaling == amp::Fp8ScalingMode::delayed &&
                          !layer->scaling->observed() && layer->scaling->device() == param.device() &&
                          layer->weight_fp8.defined() && layer->weight_fp8_t.defined() &&
                          layer->weight_scale_inv.defined();
  if (!fused() || !fused::available() || !weight_fits || !layer_fits) return false;
  fp8_copies_[param.impl_ptr().get()] = std::move(layer);
  return true;
}

void AdamW::after_update(const std::vector<ParamUpdate>& batch) {
  for (const ParamUpdate& u : batch)
    if (fp8_written_.erase(u.param.impl_ptr().get())) fp8_copies_.at(u.param.impl_ptr().get())->copies_made_from(u.param);
}

}  // namespace mpt::optim
