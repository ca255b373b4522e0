#include "train/mixed_precision.h"

#include <map>
#include <string_view>
#include <utility>

#include "autograd/engine.h"
#include "tensor/ops.h"

namespace mpt::train {

MixedPrecision::MixedPrecision(const StepOptions& options, optim::Optimizer& optimizer, DeviceType device_type)
    : optimizer_(optimizer),
      precision_(options.precision),
      device_type_(device_type),
      autocast_(options.precision != Precision::fp32),
      cast_weights_ahead_(options.cast_weights_ahead),
      autocast_dtype_(options.precision == Precision::bf16 ? DType::bf16 : DType::f16) {
  amp::scale_rule_from(options.scaler);  // the scaler's options are checked whether or not it runs
  const bool scaled = options.loss_scaling == LossScaling::always ||
                      (options.loss_scaling == LossScaling::automatic && options.precision == Precision::fp16);
  if (scaled) scaler_.emplace(options.scaler);
}

void MixedPrecision::backward(const Tensor& loss, int64_t samples) {
  mpt::backward(scaler_ ? scaler_->scale(loss, samples) : loss);
}

void MixedPrecision::unscale() {
  if (scaler_) scaler_->unscale_(optimizer_);
}

void MixedPrecision::step() {
  if (!scaler_) {
    optimizer_.step();
    return;
  }
  scaler_->step(optimizer_);
  scaler_->update();
}

OrderedDict<Tensor> MixedPrecision::state_dict() const {
  OrderedDict<Tensor> out;
  if (scaler_)
    for (const auto& [key, value] : scaler_->state_dict()) out.insert("scaler." + key, scalar_tensor(value, DType::f64));
  return out;
}

void MixedPrecision::load_state_dict(const OrderedDict<Tensor>& state) {
  if (!scaler_) {
    check(state.empty(), "the checkpoint holds loss-scaler state ({} tensors), but this run ({}) has no loss scaler",
          state.size(), precision_name(precision_));
    return;
  }
  std::map<std::string, double> values;
  for (const auto& [key, t] : state) {
    check(key.rfind("scaler.", 0) == 0 && t.defined() && t.numel() == 1,
          "unexpected loss-scaler entry '{}' in the checkpoint", key);
    values[key.substr(7)] = t.item();
  }
  check(!values.empty(), "the checkpoint has no loss-scaler state, but this run ({}) has a loss scaler",
        precision_name(precision_));
  // The scaler's rule is part of the run: a resume that silently took the
  // checkpoint's over this run's options would not be the run asked for.
  const amp::GradScalerOptions& o = scaler_->options();
  for (const auto& [field, asked] : {std::pair<std::string_view, double>{"growth_factor", o.growth_factor},
                                     {"backoff_factor", o.backoff_factor},
                                     {"growth_interval", static_cast<double>(o.growth_interval)}}) {
    const auto saved = values.find(std::string(field));
    const double had = saved == values.end() ? asked : saved->second;  // a missing one GradScaler refuses
    check(had == asked, "the checkpoint's loss scaler has {} {}, but this run's has {}", field, had, asked);
  }
  scaler_->load_state_dict(values);
}

}  // namespace mpt::train
