#pragma once
#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "autograd/ops.h"
#include "models/optimizer.h"
#include "tools/cli_checks.h"
#include "tools/mpt-train/train_config.h"

namespace mpt::train {

// The loss scaler's options as mpt-train's flags set them, checked as
// GradScaler checks them but with the flag named ("mpt-train: --init-scale
// must be ..."). Run for every run, so that a wrong value is refused also
// where no scaler runs (bf16, fp32).
inline amp::GradScalerOptions scaler_options(const TrainConfig& c) {
  amp::GradScalerOptions o;
  o.policy = amp::scale_policy_from_name(c.scaler == "dynamic" ? "torch" : c.scaler);
  o.init_scale = c.init_scale;
  o.growth_factor = c.growth_factor;
  o.backoff_factor = c.backoff_factor;
  o.growth_interval = c.growth_interval;
  amp::scale_rule_from(o, {"mpt-train", tools::flag_for_field});
  return o;
}

// The one place where mixed precision plugs in. In fp32 a step is plain
// backward() and optimizer.step(). With fp16/bf16, forward() runs under
// autocast for the model's device type, and with fp16 backward() scales the
// loss and step() is the GradScaler's unscale / inf-check / step / update
// (bf16 has f32's range and needs no scaling). The scaler's state travels in
// the checkpoint's extra tensors.
class PrecisionStep {
 public:
  PrecisionStep(const TrainConfig& c, optim::Optimizer& optimizer, const Device& device)
      : optimizer_(optimizer), device_type_(device.type) {
    check(c.precision == "fp32" || c.precision == "fp16" || c.precision == "bf16",
          "mpt-train: unknown --precision '{}' (fp16, bf16, fp32)", c.precision);
    autocast_ = c.precision != "fp32";
    dtype_ = c.precision == "bf16" ? DType::bf16 : DType::f16;
    if (c.precision == "fp16") scaler_.emplace(scaler_options(c));
  }

  // Runs f (a forward pass) under autocast, the weights cast ahead in one
  // launch; returns what f returns.
  template <typename F>
  auto forward(F&& f) {
    amp::AutocastGuard guard(device_type_, dtype_, autocast_);
    amp::cast_weights_ahead(optimizer_.scalable_parameters());
    return f();
  }
  void backward(const Tensor& loss) { mpt::backward(scaler_ ? scaler_->scale(loss) : loss); }
  // The loss scaler skips a step whose gradients hold inf/NaN (deciding on
  // the device with a capturable optimizer, so nothing here waits for it).
  void step() {
    if (!scaler_) {
      optimizer_.step();
      return;
    }
    scaler_->step(optimizer_);
    scaler_->update();
  }
  amp::GradScaler* scaler() { return scaler_ ? &*scaler_ : nullptr; }
  double scale() const { return scaler_ ? scaler_->get_scale() : 1.0; }

  // The scaler's state as 0-d f64 tensors, named as GradScaler::state_dict names it.
  OrderedDict<Tensor> state_dict() const {
    OrderedDict<Tensor> out;
    if (scaler_)
      for (const auto& [key, value] : scaler_->state_dict()) out.insert("scaler." + key, scalar_tensor(value, DType::f64));
    return out;
  }
  // Checks before changing anything (GradScaler::load_state_dict does too).
  void load_state_dict(const OrderedDict<Tensor>& state) {
    if (!scaler_) {
      check(state.empty(), "mpt-train: the checkpoint holds loss-scaler state ({} tensors) but this run is {}",
            state.size(), autocast_ ? "bf16" : "fp32");
      return;
    }
    std::map<std::string, double> values;
    for (const auto& [key, t] : state) {
      check(key.rfind("scaler.", 0) == 0 && t.defined() && t.numel() == 1,
            "mpt-train: unexpected loss-scaler entry '{}' in the checkpoint", key);
      values[key.substr(7)] = t.item();
    }
    check(!values.empty(), "mpt-train: the checkpoint has no loss-scaler state, but this run is fp16");
    // The scaler's rule is part of the run: a resume that silently took the
    // checkpoint's over this run's flags would not be the run asked for.
    const amp::GradScalerOptions& o = scaler_->options();
    for (const auto& [field, asked] : {std::pair<std::string_view, double>{"growth_factor", o.growth_factor},
                                       {"backoff_factor", o.backoff_factor},
                                       {"growth_interval", static_cast<double>(o.growth_interval)}}) {
      const auto saved = values.find(std::string(field));
      const double had = saved == values.end() ? asked : saved->second;  // a missing one GradScaler refuses
      check(had == asked,
            "mpt-train: the checkpoint's loss scaler has {} {}, but this run has {} {}; resume with the "
            "checkpoint's value",
            field, had, tools::flag_for_field(field), asked);
    }
    scaler_->load_state_dict(values);
  }

 private:
  optim::Optimizer& optimizer_;
  DeviceType device_type_;
  bool autocast_ = false;
  DType dtype_ = DType::f16;
  std::optional<amp::GradScaler> scaler_;
};

}  // namespace mpt::train
