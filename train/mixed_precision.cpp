#include "train/mixed_precision.h"

#include <map>
#include <string_view>
#include <utility>

#include "autograd/engine.h"
#include "models/layers.h"
#include "tensor/ops.h"

namespace mpt::train {

MixedPrecision::MixedPrecision(const StepOptions& options, optim::Optimizer& optimizer, DeviceType device_type)
    : optimizer_(optimizer),
      precision_(options.precision),
      device_type_(device_type),
      autocast_(options.precision != Precision::fp32),
      // FP8 layers quantize the f32 weights themselves: a bf16 copy of every
      // weight ahead would be made for the few layers that use one.
      cast_weights_ahead_(options.cast_weights_ahead && options.precision != Precision::fp8),
      autocast_dtype_(options.precision == Precision::fp16 ? DType::f16 : DType::bf16),
      fp8_recipe_(options.fp8),
      fp8_copies_in_optimizer_(options.fp8_copies_in_optimizer),
      fp8_fused_mlp_(options.fp8_fused_mlp) {
  if (options.precision == Precision::fp8) amp::check_fp8_recipe(options.fp8);
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

void MixedPrecision::attach_fp8(nn::Module& model, const Device& device) {
  check<ValueError>(precision_ == Precision::fp8, "attach_fp8: the precision is {}, not fp8", precision_name(precision_));
  std::vector<std::pair<std::string, nn::Linear*>> layers;
  for (const auto& [name, m] : model.named_modules())
    if (auto* linear = dynamic_cast<nn::Linear*>(m)) layers.emplace_back(name, linear);
  check<ValueError>(layers.size() >= 2,
                    "attach_fp8: the model has {} linear layer(s); FP8 runs every one but the last (the output head)",
                    layers.size());
  fp8_ = std::make_shared<amp::Fp8Scaling>(fp8_recipe_, device);
  layers.pop_back();
  fp8_layers_.clear();
  for (const auto& [name, l] : layers) {
    l->fp8 = std::make_shared<amp::Fp8LinearState>(amp::Fp8LinearState::for_layer(fp8_, name));
    l->fp8->fused_mlp = fp8_fused_mlp_;
    fp8_layers_.push_back({l->weight, l->fp8});
  }
}

void MixedPrecision::step() {
  // The FP8 scales first: the step's amaxes are all in, and an optimizer
  // that writes the weights' FP8 copies in its own pass makes them with the
  // scales the next forward would have used.
  if (fp8_) {
    if (fp8_amax_reducer_)
      for (amp::Fp8Group g : {amp::Fp8Group::forward, amp::Fp8Group::backward}) fp8_amax_reducer_(fp8_->amax(g));
    fp8_->update();
    if (fp8_copies_in_optimizer_)
      for (Fp8Layer& l : fp8_layers_)
        if (!l.offered && l.state->weight_fp8.defined()) {
          optimizer_.write_fp8_copies(l.weight, l.state);
          l.offered = true;
        }
  }
  if (!scaler_) {
    optimizer_.step();
  } else {
    scaler_->step(optimizer_);
    scaler_->update();
  }
}

OrderedDict<Tensor> MixedPrecision::state_dict() const {
  OrderedDict<Tensor> out;
  if (scaler_)
    for (const auto& [key, value] : scaler_->state_dict()) out.insert("scaler." + key, scalar_tensor(value, DType::f64));
  if (fp8_)
    for (const auto& [key, t] : fp8_->state()) out.insert("fp8." + key, t);
  return out;
}

void MixedPrecision::load_state_dict(const OrderedDict<Tensor>& all) {
  // Everything is checked before anything changes: the FP8 state first,
  // then the loss scaler's (which checks its own before loading).
  OrderedDict<Tensor> state;
  std::vector<std::pair<std::string, Tensor>> fp8_state;
  for (const auto& [key, t] : all) {
    if (key.rfind("fp8.", 0) == 0) fp8_state.emplace_back(key.substr(4), t);
    else state.insert(key, t);
  }
  if (fp8_) {
    check(!fp8_state.empty(), "the checkpoint has no FP8 scaling state, but this run is fp8");
    fp8_->check_state(fp8_state);
  } else {
    check(fp8_state.empty(), "the checkpoint holds FP8 scaling state ({} tensors), but this run ({}) is not fp8",
          fp8_state.size(), precision_name(precision_));
  }
  load_scaler_state(state);
  if (fp8_) fp8_->load_state(fp8_state);  // checked above: copies only
}

void MixedPrecision::load_scaler_state(const OrderedDict<Tensor>& state) {
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
