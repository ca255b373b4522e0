#pragma once
// GradScaler: dynamic loss scaling with torch.amp.GradScaler's defaults and
// contract, plus other policies, a growth interval in other units, a
// per-step trace and collapse warnings.
//
//   amp::GradScaler scaler;                       // 65536, x2 every 2000 clean steps, x0.5 on overflow
//   for (...) {
//     optimizer.zero_grad();
//     Tensor loss = ...;                          // under amp::AutocastGuard
//     backward(scaler.scale(loss));
//     scaler.unscale_(optimizer);                 // optional: before clipping gradients
//     scaler.step(optimizer);                     // skipped when a gradient is inf/NaN
//     scaler.update();
//   }
//
// Device state: the scale (f32 [1]), the growth tracker (i64 [1]) and the
// hysteresis counter (i32 [1]) live on the device of the first loss passed to
// scale(); each device holding gradients gets its own found_inf (f32 [1]),
// and the scaler combines them (max) onto the scale's device, then hands the
// result to the rank reducer if one is installed, so every device and every
// rank takes the same decision with one scaler. unscale_ is one fused pass
// per device; update() runs the rule on the device. A step costs one host
// sync (reading found_inf and the scale together) with an optimizer that
// decides on the host, none with one that reads found_inf on the device
// (ScalableOptimizer::skips_on_device). Tracing syncs more.
//
// Collapse warnings (an overflow at a scale below 1, or at min_scale) need
// the host to see found_inf: they come with a host-side optimizer, or with a
// device-side one while tracing. Naming the first non-finite gradient costs
// a sync per gradient, paid only then.
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "amp/late_gradients.h"
#include "amp/scalable_optimizer.h"
#include "amp/scale_rule.h"
#include "amp/scaler_trace.h"
#include "tensor/tensor.h"

namespace mpt::amp {

// What growth_interval counts.
enum class GrowthUnit {
  optimizer_steps,  // PyTorch's meaning
  micro_batches,    // scale() calls: keeps the growth rate when gradient accumulation changes
  samples,          // samples passed to scale(loss, samples): keeps it when the batch or world size changes
                    // (under data parallelism, pass the samples of the whole step across ranks)
};

struct GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  bool enabled = true;
  ScalePolicy policy = ScalePolicy::torch;
  int32_t hysteresis = 2;               // hysteresis policy: overflows tolerated before backing off
  bool consecutive_hysteresis = false;  // hysteresis policy: a clean step restores the allowance
  std::optional<double> min_scale;      // floor for back-off
  std::optional<double> max_scale;      // cap for growth
  GrowthUnit growth_unit = GrowthUnit::optimizer_steps;
};

const char* scale_policy_name(ScalePolicy policy);
ScalePolicy scale_policy_from_name(const std::string& name);  // "torch", "hysteresis", "static"
GrowthUnit growth_unit_from_name(const std::string& name);    // "steps", "micro_batches", "samples"
// How scale_rule_from's errors name what they refuse: the owner of the
// options and each option's field, so that a command line can name its own
// flags ("mpt-train: --init-scale must be ...").
struct OptionNames {
  std::string owner = "GradScaler";
  std::function<std::string(std::string_view field)> field = [](std::string_view f) { return std::string(f); };
};
// The rule constants the options describe (ValueError for invalid options).
ScaleRule scale_rule_from(const GradScalerOptions& options, const OptionNames& names = {});

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});
  // A copy would share the device state tensors with the original.
  GradScaler(const GradScaler&) = delete;
  GradScaler& operator=(const GradScaler&) = delete;
  GradScaler(GradScaler&&) = default;
  GradScaler& operator=(GradScaler&&) = default;

  // loss * scale (differentiable). The first call places the scaler's state
  // on the loss's device. `samples` counts towards growth when growth_unit is
  // samples (ValueError if it is then 0).
  Tensor scale(const Tensor& loss, int64_t samples = 0);

  // Divides the optimizer's gradients by the scale in place and records
  // whether any is inf/NaN. At most once per optimizer between updates
  // (ValueError otherwise); step() calls it when you did not.
  void unscale_(ScalableOptimizer& optimizer);
  // Steps the optimizer unless its gradients held inf/NaN. Once per
  // optimizer between updates, and only when one of its parameters has a
  // gradient (ValueError otherwise).
  void step(ScalableOptimizer& optimizer);
  // Applies the policy's rule once, from the found_inf of every optimizer
  // stepped or unscaled since the last update (ValueError if none was).
  void update();
  // Sets the scale directly (PyTorch's update(new_scale)): tracker unchanged.
  void update(double new_scale);

  bool is_enabled() const { return options_.enabled; }
  const GradScalerOptions& options() const { return options_; }
  // Reads the device state (host syncs; for logging, tests and checkpoints).
  double get_scale() const;
  int64_t growth_tracker() const;
  int32_t hysteresis_left() const;
  // The scale as a device tensor, no sync (undefined before the first scale()).
  const Tensor& scale_tensor() const { return scale_; }
  int64_t steps() const { return step_; }  // update() calls so far
  // Host syncs the scaler itself has made (tests check the per-step budget).
  int64_t host_syncs() const { return host_syncs_; }

  // "scale", "growth_factor", "backoff_factor", "growth_interval",
  // "_growth_tracker" (PyTorch's keys, so either library loads the other's
  // state), "hysteresis_left", "step": every value is exact as a double.
  // Loading checks every entry before changing anything; it also takes a
  // tracker saved as "growth_tracker".
  std::map<std::string, double> state_dict() const;
  void load_state_dict(const std::map<std::string, double>& state);

  // Combines found_inf (f32 [1] on the scale's device) across ranks in
  // place, with max; the data-parallel layer installs an all-reduce here.
  void set_found_inf_reducer(std::function<void(Tensor& found_inf)> reducer) { reducer_ = std::move(reducer); }
  // Gradients that may still be arriving when backward returns (installed by
  // DistributedDataParallel::overlap_step_with): unscale_() waits for them
  // first; step() without an earlier unscale_() steps the other parameters
  // meanwhile, when the optimizer steps in parts.
  void add_late_gradient_source(LateGradientSource source) { late_sources_.push_back(std::move(source)); }
  // Receives one row per update() (costs host syncs; null turns it off).
  void set_trace_sink(ScalerTraceSink sink) { trace_ = std::move(sink); }
  // Where collapse warnings go (default: standard error).
  void set_warning_sink(std::function<void(const std::string&)> sink) { warn_ = std::move(sink); }

 private:
  enum class Stage { ready, unscaled, stepped };
  struct PerOptimizer {
    Stage stage = Stage::ready;
    Tensor found_inf;  // on the scale's device
    std::vector<Tensor> params;
  };

  // The host's view of a step's skip decision, once read.
  struct StepDecision {
    std::optional<bool> found;
    double used_scale = 0;
  };

  void check_scale_exists(const char* fn) const;
  std::vector<LateGradients> take_late_gradients();
  // Unscales the gradients of `params` (one fused pass per device); their
  // inf/NaN flag, on the scale's device.
  Tensor unscale_gradients(const std::vector<Tensor>& params);
  // Steps `only` (null: every parameter) unless found_inf is set; where the
  // host decides, the decision is read once and kept in `decision`.
  void step_unless_found(ScalableOptimizer& optimizer, const Tensor& found_inf, const std::vector<Tensor>* only,
                         StepDecision& decision);
  std::string first_nonfinite_gradient(const std::vector<Tensor>& params) const;
  double grad_norm(const std::vector<Tensor>& params) const;
  void warn_collapse(double used_scale);

  GradScalerOptions options_;
  ScaleRule rule_;
  ScaleState pending_;  // the state until scale() places it on a device
  Tensor scale_, growth_tracker_, hysteresis_left_;
  std::unordered_map<const ScalableOptimizer*, PerOptimizer> per_optimizer_;
  int64_t step_ = 0;
  int64_t micro_batches_ = 0;  // scale() calls since the last update
  int64_t samples_ = 0;        // samples passed to scale() since the last update
  int64_t host_syncs_ = 0;
  // The scale this step used, when the host has read it (for the trace).
  std::optional<double> used_scale_host_;
  std::string first_nonfinite_;
  double grad_norm_sq_ = 0;
  std::function<void(Tensor&)> reducer_;
  std::vector<LateGradientSource> late_sources_;
  ScalerTraceSink trace_;
  std::function<void(const std::string&)> warn_;
};

}  // namespace mpt::amp
