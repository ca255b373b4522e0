#pragma once
// The one place where mixed precision plugs into a step. In fp32 a step is
// plain backward() and optimizer.step(). In fp16 and bf16, forward() runs
// under autocast for the model's device type with the weights cast ahead in
// one launch (f32 master weights stay the optimizer's), and in fp16
// backward() scales the loss and step() is the GradScaler's unscale,
// inf-check, step and update: a step whose gradients hold inf/NaN is
// skipped. The scaler's state travels in checkpoints (state_dict()).
// In fp8, attach_fp8() gives the model's linear layers FP8 state, forward()
// runs them in FP8 under bf16 autocast, and step() updates their scales
// after the optimizer's step; the scales travel in checkpoints too.
#include <functional>
#include <memory>
#include <optional>

#include "amp/autocast.h"
#include "amp/fp8_linear.h"
#include "amp/fp8_scaling.h"
#include "amp/grad_scaler.h"
#include "models/module.h"
#include "models/optimizer.h"
#include "models/ordered_dict.h"
#include "train/options.h"

namespace mpt::train {

class MixedPrecision {
 public:
  // The precision, the scaler's options, whether it runs, and whether the
  // weights are cast ahead come from `options`.
  MixedPrecision(const StepOptions& options, optim::Optimizer& optimizer, DeviceType device_type);

  Precision precision() const { return precision_; }

  // Runs f (a forward pass) under autocast; returns what f returns.
  template <typename F>
  auto forward(F&& f) {
    amp::AutocastGuard guard(device_type_, autocast_dtype_, autocast_);
    amp::Fp8Guard fp8_guard(fp8_ != nullptr);
    if (autocast_ && cast_weights_ahead_) amp::cast_weights_ahead(optimizer_.scalable_parameters());
    return f();
  }

  // fp8 only: gives every nn::Linear of `model` but the last (its output
  // head) FP8 state on `device`, in module order. ValueError where the
  // precision is not fp8 or the model has no linear layer to run in FP8.
  void attach_fp8(nn::Module& model, const Device& device);
  // Reduces the step's running amaxes (f32 tensors, to become their maximum
  // over the replicas) before the scales are updated: DDP's all-reduce.
  void set_fp8_amax_reducer(std::function<void(Tensor&)> reducer) { fp8_amax_reducer_ = std::move(reducer); }
  amp::Fp8Scaling* fp8_scaling() { return fp8_.get(); }
  // backward() of the loss, scaled in fp16 (`samples` counts towards the
  // scaler's growth when it grows by samples).
  void backward(const Tensor& loss, int64_t samples = 0);
  // Divides the gradients by the scale now (fp16), so that they can be
  // clipped before step(); nothing otherwise.
  void unscale();
  // The optimizer's step (skipped on overflow in fp16, the decision made on
  // the device with a capturable optimizer), then the scaler's update.
  void step();

  amp::GradScaler* scaler() { return scaler_ ? &*scaler_ : nullptr; }
  const amp::GradScaler* scaler() const { return scaler_ ? &*scaler_ : nullptr; }
  // The loss scale (1 without a scaler); reads the device.
  double scale() const { return scaler_ ? scaler_->get_scale() : 1.0; }

  // The scaler's state as 0-d f64 tensors named "scaler.<key>" (GradScaler's
  // keys), and in fp8 the scaling state as "fp8.<name>" (Fp8Scaling's).
  OrderedDict<Tensor> state_dict() const;
  // Checks everything before changing anything: ValueError for state of a
  // scaler in a run without one (or none in an fp16 run), an unknown entry,
  // or a rule (growth factor, backoff factor, growth interval) other than
  // this scaler's.
  void load_state_dict(const OrderedDict<Tensor>& state);

 private:
  void load_scaler_state(const OrderedDict<Tensor>& state);


 private:
  optim::Optimizer& optimizer_;
  Precision precision_;
  DeviceType device_type_;
  bool autocast_;
  bool cast_weights_ahead_;
  DType autocast_dtype_;
  std::optional<amp::GradScaler> scaler_;
  amp::Fp8Recipe fp8_recipe_;
  std::shared_ptr<amp::Fp8Scaling> fp8_;
  // The FP8 layers' weights and states, and whether each was offered to
  // the optimizer (once its copies exist: after its first forward).
  struct Fp8Layer {
    Tensor weight;
    std::shared_ptr<amp::Fp8LinearState> state;
    bool offered = false;
  };
  std::vector<Fp8Layer> fp8_layers_;
  bool fp8_copies_in_optimizer_;
  bool fp8_fused_mlp_;
  std::function<void(Tensor&)> fp8_amax_reducer_;
};

}  // namespace mpt::train
