#include "amp/grad_scaler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <unordered_set>

#include <fmt/format.h>

#include "amp/amp_cuda.h"
#include "amp/unscale.h"
#include "autograd/grad_mode.h"
#include "autograd/ops.h"

namespace mpt::amp {
namespace {

constexpr double kF32Max = 3.4028234663852886e38;

// Whole and within 2^53 (where doubles stop counting exactly; past 2^63 the
// conversion to int64 would be undefined).
bool is_whole(double v) { return std::isfinite(v) && v == std::floor(v) && std::fabs(v) <= 9007199254740992.0; }

std::string param_name(const Tensor& p, size_t index) {
  const std::string& name = p.autograd_meta().name;
  return name.empty() ? fmt::format("parameter {}", index) : name;
}

}  // namespace

const char* scale_policy_name(ScalePolicy policy) {
  switch (policy) {
    case ScalePolicy::torch: return "torch";
    case ScalePolicy::hysteresis: return "hysteresis";
    case ScalePolicy::fixed: return "static";
  }
  return "?";
}

ScalePolicy scale_policy_from_name(const std::string& name) {
  if (name == "torch") return ScalePolicy::torch;
  if (name == "hysteresis") return ScalePolicy::hysteresis;
  if (name == "static") return ScalePolicy::fixed;
  throw ValueError(fmt::format("GradScaler: unknown policy '{}' (expected torch, hysteresis or static)", name));
}

GrowthUnit growth_unit_from_name(const std::string& name) {
  if (name == "steps") return GrowthUnit::optimizer_steps;
  if (name == "micro_batches") return GrowthUnit::micro_batches;
  if (name == "samples") return GrowthUnit::samples;
  throw ValueError(
      fmt::format("GradScaler: unknown growth unit '{}' (expected steps, micro_batches or samples)", name));
}

ScaleRule scale_rule_from(const GradScalerOptions& o, const OptionNames& names) {
  const std::string& owner = names.owner;
  const auto name = [&](std::string_view field) { return names.field(field); };
  check(std::isfinite(o.init_scale) && o.init_scale > 0 && o.init_scale <= kF32Max,
        "{}: {} must be positive and within f32 range, got {}", owner, name("init_scale"), o.init_scale);
  // As PyTorch requires: a factor of 1 is no dynamic scaling at all (a fixed scale is ScalePolicy::fixed).
  check(std::isfinite(o.growth_factor) && o.growth_factor > 1.0, "{}: {} must be > 1, got {}", owner,
        name("growth_factor"), o.growth_factor);
  check(o.backoff_factor > 0.0 && o.backoff_factor < 1.0, "{}: {} must be in (0, 1), got {}", owner,
        name("backoff_factor"), o.backoff_factor);
  check(o.growth_interval >= 1, "{}: {} must be >= 1, got {}", owner, name("growth_interval"), o.growth_interval);
  check(o.hysteresis >= 1, "{}: {} must be >= 1, got {}", owner, name("hysteresis"), o.hysteresis);
  const double min_scale = o.min_scale.value_or(0.0);
  const double max_scale = o.max_scale.value_or(kF32Max);
  check(std::isfinite(min_scale) && min_scale >= 0, "{}: {} must be >= 0 and finite, got {}", owner,
        name("min_scale"), min_scale);
  check(max_scale > 0 && max_scale <= kF32Max, "{}: {} must be positive and within f32 range, got {}", owner,
        name("max_scale"), max_scale);
  check(min_scale <= max_scale, "{}: {} {} is above {} {}", owner, name("min_scale"), min_scale, name("max_scale"),
        max_scale);
  // A scale outside the bounds would stay there until the rule first moved
  // it (an overflow would raise it to the floor), and the scaler's own
  // state_dict() would not load back.
  check(o.init_scale >= min_scale && o.init_scale <= max_scale, "{}: {} {} is outside [{}, {}] = [{}, {}]", owner,
        name("init_scale"), o.init_scale, name("min_scale"), name("max_scale"), min_scale, max_scale);
  ScaleRule rule;
  rule.policy = o.policy;
  rule.growth_factor = o.growth_factor;
  rule.backoff_factor = o.backoff_factor;
  rule.growth_interval = o.growth_interval;
  rule.min_scale = static_cast<float>(min_scale);
  rule.max_scale = static_cast<float>(max_scale);
  rule.hysteresis = o.hysteresis;
  rule.consecutive_hysteresis = o.consecutive_hysteresis;
  return rule;
}

// A disabled scaler checks nothing, as torch.amp.GradScaler(enabled=False):
// a run can turn scaling off without making its other options valid.
GradScaler::GradScaler(GradScalerOptions options)
    : options_(std::move(options)), rule_(options_.enabled ? scale_rule_from(options_) : ScaleRule{}) {
  pending_.scale = static_cast<float>(options_.init_scale);
  pending_.growth_tracker = 0;
  pending_.hysteresis_left = options_.hysteresis;
  warn_ = [](const std::string& message) { std::fprintf(stderr, "warning: %s\n", message.c_str()); };
}

void GradScaler::check_scale_exists(const char* fn) const {
  check(scale_.defined(),
        "GradScaler::{}: the scale does not exist yet; call scale(loss) and backward on it earlier in the step", fn);
}

Tensor GradScaler::scale(const Tensor& loss, int64_t samples) {
  if (!options_.enabled) return loss;
  check(loss.defined(), "GradScaler::scale: the loss is an undefined tensor");
  check<DTypeError>(is_floating(loss.dtype()) && !is_float8(loss.dtype()),
                    "GradScaler::scale: the loss must be f32, f16, bf16 or f64, got {}", describe(loss));
  check(samples >= 0, "GradScaler::scale: samples must be >= 0, got {}", samples);
  check(options_.growth_unit != GrowthUnit::samples || samples > 0,
        "GradScaler::scale: growth_interval counts samples, so pass the micro-batch's sample count (got {})",
        samples);
  if (!scale_.defined()) {
    const Device dev = loss.device();
    scale_ = full({1}, pending_.scale, DType::f32, dev);
    growth_tracker_ = full({1}, static_cast<double>(pending_.growth_tracker), DType::i64, dev);
    hysteresis_left_ = full({1}, pending_.hysteresis_left, DType::i32, dev);
  }
  ++micro_batches_;
  samples_ += samples;
  return mul(loss, prim::reshape(prim::to(scale_, loss.device()), {}));
}

std::vector<LateGradients> GradScaler::take_late_gradients() {
  std::vector<LateGradients> late;
  for (const LateGradientSource& source : late_sources_)
    if (std::optional<LateGradients> l = source()) late.push_back(std::move(*l));
  return late;
}

Tensor GradScaler::unscale_gradients(const std::vector<Tensor>& params) {
  NoGradGuard no_grad;
  const Device home = scale_.device();
  const Tensor inv_scale = prim::to(prim::unary(UnaryOp::reciprocal, prim::to(scale_, DType::f64)), DType::f32);
  // One fused pass per device, in the order the devices first appear.
  std::vector<Device> devices;
  std::vector<std::vector<Tensor>> grads_by_device;
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor g = params[i].grad();
    if (!g.defined()) continue;
    // Checked for every gradient before any is touched: a bad one fails the
    // call with nothing unscaled (the messages made only for a failure).
    // f16 gradients are refused as torch.amp.GradScaler refuses them: an
    // f16 parameter stepped with its unscaled f16 gradient loses the small
    // updates the scale was there to keep (keep f32 master weights and let
    // autocast cast them).
    if (g.dtype() == DType::f16)
      throw DTypeError(fmt::format("GradScaler::unscale_: the gradient of {} is {}; f16 gradients cannot be unscaled "
                                   "(keep the parameters in f32 and run the forward pass under autocast)",
                                   param_name(params[i], i), describe(g)));
    if (g.dtype() != DType::f32 && g.dtype() != DType::bf16)
      throw DTypeError(fmt::format("GradScaler::unscale_: the gradient of {} is {}; expected f32 or bf16",
                                   param_name(params[i], i), describe(g)));
    if (!g.is_contiguous())
      throw ValueError(fmt::format("GradScaler::unscale_: the gradient of {} ({}) is not contiguous",
                                   param_name(params[i], i), describe(g)));
    size_t d = 0;
    while (d < devices.size() && devices[d] != g.device()) ++d;
    if (d == devices.size()) {
      devices.push_back(g.device());
      grads_by_device.emplace_back();
    }
    grads_by_device[d].push_back(g);
  }
  Tensor found = zeros({1}, DType::f32, home);
  for (size_t d = 0; d < devices.size(); ++d) {
    Tensor found_here = devices[d] == home ? found : zeros({1}, DType::f32, devices[d]);
    const Tensor inv_here = devices[d] == home ? inv_scale : prim::to(inv_scale, devices[d]);
    unscale_and_check_inf_(grads_by_device[d], found_here, inv_here);
    if (devices[d] != home) found = prim::binary(BinaryOp::maximum, found, prim::to(found_here, home));
  }
  return found;
}

void GradScaler::unscale_(ScalableOptimizer& optimizer) {
  // Every gradient is final before anyone reads it (to clip, say).
  for (LateGradients& late : take_late_gradients()) late.wait();
  if (!options_.enabled) return;
  check_scale_exists("unscale_");
  PerOptimizer& st = per_optimizer_[&optimizer];
  check(st.stage != Stage::unscaled,
        "GradScaler::unscale_: already called for this optimizer since the last update() (unscaling twice would "
        "divide the gradients by the scale twice)");
  check(st.stage != Stage::stepped, "GradScaler::unscale_: called after step() for this optimizer; call update() first");

  std::vector<Tensor> params = optimizer.scalable_parameters();
  Tensor found = unscale_gradients(params);
  if (reducer_) reducer_(found);
  st.found_inf = found;
  st.params = std::move(params);
  st.stage = Stage::unscaled;
  if (trace_) grad_norm_sq_ += std::pow(grad_norm(st.params), 2);
}

void GradScaler::step_unless_found(ScalableOptimizer& optimizer, const Tensor& found_inf,
                                   const std::vector<Tensor>* only, StepDecision& decision) {
  if (optimizer.skips_on_device()) {
    if (only) optimizer.step_part(*only, found_inf);
    else optimizer.step_skipping_if(found_inf);
    if (trace_ && !decision.found) {
      decision.found = found_inf.item() != 0.0;
      decision.used_scale = scale_.item();
    }
    return;
  }
  if (!decision.found) {
    // found_inf and the scale in one read: the step's only host sync.
    const std::vector<float> both = prim::cat({found_inf, scale_}, 0).to_vector<float>();
    ++host_syncs_;
    decision.found = both[0] != 0.0f;
    decision.used_scale = both[1];
  }
  if (*decision.found) return;
  if (only) optimizer.step_part(*only, Tensor());
  else optimizer.step();
}

void GradScaler::step(ScalableOptimizer& optimizer) {
  std::vector<LateGradients> late = take_late_gradients();
  // In parts: the parameters whose gradients are final step first, while
  // the late ones travel; those step once they have arrived.
  std::vector<Tensor> early, later;
  if (!late.empty()) {
    std::unordered_set<const void*> late_params;
    for (const LateGradients& l : late)
      for (const Tensor& p : l.params) late_params.insert(p.data_ptr());
    for (const Tensor& p : optimizer.scalable_parameters())
      (late_params.count(p.data_ptr()) ? later : early).push_back(p);
  }
  const bool in_parts = !early.empty() && !later.empty() && optimizer.steps_in_parts() &&
                        (!options_.enabled || per_optimizer_[&optimizer].stage == Stage::ready);
  auto wait_for_late = [&] {
    for (LateGradients& l : late) l.wait();
  };
  if (!in_parts) wait_for_late();
  if (!options_.enabled) {
    if (!in_parts) {
      optimizer.step();
      return;
    }
    optimizer.step_part(early, Tensor());
    wait_for_late();
    optimizer.step_part(later, Tensor());
    return;
  }
  check_scale_exists("step");
  check(per_optimizer_[&optimizer].stage != Stage::stepped,
        "GradScaler::step: already called for this optimizer since the last update()");
  StepDecision decision;
  if (in_parts) {
    // One decision for both parts: the late gradients were checked on every
    // rank before they were averaged, and an average of finite values
    // (divided before it is summed) is finite, so their flag is what the
    // check of the averages would say.
    PerOptimizer& st = per_optimizer_[&optimizer];
    Tensor found = unscale_gradients(early);
    for (LateGradients& l : late) {
      l.wait_for_check();
      found = prim::binary(BinaryOp::maximum, found, prim::to(l.nonfinite, found.device()));
    }
    if (reducer_) reducer_(found);
    st.found_inf = found;
    st.params = optimizer.scalable_parameters();
    step_unless_found(optimizer, found, &early, decision);
    wait_for_late();
    (void)unscale_gradients(later);
    step_unless_found(optimizer, found, &later, decision);
    if (trace_) grad_norm_sq_ += std::pow(grad_norm(st.params), 2);
  } else {
    PerOptimizer& st = per_optimizer_[&optimizer];
    if (st.stage == Stage::ready) unscale_(optimizer);
    // As torch.amp.GradScaler ("No inf checks were recorded for this
    // optimizer"): a step with nothing checked would count as a clean one
    // towards the scale's growth.
    check(std::any_of(st.params.begin(), st.params.end(), [](const Tensor& p) { return p.grad().defined(); }),
          "GradScaler::step: none of the optimizer's {} parameters has a gradient, so no inf check was recorded "
          "for it; did the loss reach them through backward()?",
          st.params.size());
    step_unless_found(optimizer, st.found_inf, nullptr, decision);
  }
  PerOptimizer& st = per_optimizer_[&optimizer];
  st.stage = Stage::stepped;
  if (!decision.found) return;
  const double used_scale = decision.used_scale;
  used_scale_host_ = used_scale;
  if (!*decision.found) return;
  const bool collapsed = used_scale < 1.0 || (rule_.min_scale > 0 && used_scale <= rule_.min_scale);
  if ((trace_ || collapsed) && first_nonfinite_.empty()) first_nonfinite_ = first_nonfinite_gradient(st.params);
  if (collapsed) warn_collapse(used_scale);
}

void GradScaler::warn_collapse(double used_scale) {
  if (!warn_) return;
  const std::string where = used_scale < 1.0 ? "below 1" : fmt::format("at the floor min_scale = {}", rule_.min_scale);
  warn_(fmt::format(
      "GradScaler: step {}: gradients overflowed at loss scale {} ({}); first non-finite gradient: {}. The scale "
      "cannot fix this: look for inf/NaN in the forward pass (learning rate, data, an op that needs f32).",
      step_, used_scale, where, first_nonfinite_.empty() ? std::string("(none found)") : first_nonfinite_));
}

void GradScaler::update() {
  if (!options_.enabled) return;
  check_scale_exists("update");
  Tensor found;
  for (auto& [opt, st] : per_optimizer_) {
    if (st.stage == Stage::ready) continue;
    found = found.defined() ? prim::binary(BinaryOp::maximum, found, st.found_inf) : st.found_inf;
  }
  check(found.defined(),
        "GradScaler::update: no inf checks were recorded since the last update(); call step(optimizer) or "
        "unscale_(optimizer) first");
  int64_t units = 1;
  if (options_.growth_unit == GrowthUnit::micro_batches) units = micro_batches_;
  if (options_.growth_unit == GrowthUnit::samples) units = samples_;

  ScalerTraceRow row;
  if (trace_) {
    row.scale = used_scale_host_ ? *used_scale_host_ : scale_.item();
    row.found_inf = found.item() != 0.0;  // all optimizers together (tracing may sync)
  }
  if (scale_.device().is_cuda()) {
    cuda::update_scale(scale_, growth_tracker_, hysteresis_left_, found, rule_, units);
  } else {
    update_scale(rule_, *found.data<float>() != 0.0f, units, scale_.data<float>(), growth_tracker_.data<int64_t>(),
                 hysteresis_left_.data<int32_t>());
  }
  if (trace_) {
    row.step = step_;
    row.policy = options_.policy;
    row.next_scale = get_scale();
    row.growth_tracker = growth_tracker();
    row.hysteresis_left = hysteresis_left();
    row.skipped = row.found_inf;
    row.first_nonfinite = first_nonfinite_;
    row.grad_norm = row.found_inf ? std::numeric_limits<double>::infinity() : std::sqrt(grad_norm_sq_);
    trace_(row);
  }
  per_optimizer_.clear();
  micro_batches_ = 0;
  samples_ = 0;
  used_scale_host_.reset();
  first_nonfinite_.clear();
  grad_norm_sq_ = 0;
  ++step_;
}

void GradScaler::update(double new_scale) {
  if (!options_.enabled) return;
  check(std::isfinite(new_scale) && new_scale > 0 && new_scale <= kF32Max,
        "GradScaler::update: new_scale must be positive and within f32 range, got {}", new_scale);
  check_scale_exists("update");
  prim::fill_(scale_, new_scale);
  per_optimizer_.clear();
  micro_batches_ = 0;
  samples_ = 0;
  used_scale_host_.reset();
  first_nonfinite_.clear();
  grad_norm_sq_ = 0;
  ++step_;
}

double GradScaler::get_scale() const {
  if (!options_.enabled) return 1.0;
  return scale_.defined() ? scale_.item() : pending_.scale;
}

int64_t GradScaler::growth_tracker() const {
  return growth_tracker_.defined() ? growth_tracker_.to_vector<int64_t>()[0] : pending_.growth_tracker;
}

int32_t GradScaler::hysteresis_left() const {
  return hysteresis_left_.defined() ? hysteresis_left_.to_vector<int32_t>()[0] : pending_.hysteresis_left;
}

std::map<std::string, double> GradScaler::state_dict() const {
  if (!options_.enabled) return {};
  return {{"scale", get_scale()},
          {"growth_factor", options_.growth_factor},
          {"backoff_factor", options_.backoff_factor},
          {"growth_interval", static_cast<double>(options_.growth_interval)},
          {"_growth_tracker", static_cast<double>(growth_tracker())},
          {"hysteresis_left", static_cast<double>(hysteresis_left())},
          {"step", static_cast<double>(step_)}};
}

void GradScaler::load_state_dict(const std::map<std::string, double>& state) {
  if (!options_.enabled) return;
  check(!state.empty(),
        "GradScaler::load_state_dict: the state is empty (was it saved from a disabled GradScaler?)");
  auto get = [&](const char* key) {
    auto it = state.find(key);
    check(it != state.end(), "GradScaler::load_state_dict: missing entry '{}'", key);
    return it->second;
  };
  GradScalerOptions options = options_;
  options.growth_factor = get("growth_factor");
  options.backoff_factor = get("backoff_factor");
  const double interval = get("growth_interval");
  check(is_whole(interval) && interval >= 1, "GradScaler::load_state_dict: growth_interval {} is not a positive integer",
        interval);
  options.growth_interval = static_cast<int64_t>(interval);
  const double scale = get("scale");
  check(std::isfinite(scale) && scale > 0 && scale <= kF32Max,
        "GradScaler::load_state_dict: scale {} is not positive and finite", scale);
  check((!options_.min_scale || scale >= *options_.min_scale) && (!options_.max_scale || scale <= *options_.max_scale),
        "GradScaler::load_state_dict: scale {} is outside this scaler's [min_scale, max_scale] = [{}, {}]", scale,
        options_.min_scale ? fmt::format("{}", *options_.min_scale) : "none",
        options_.max_scale ? fmt::format("{}", *options_.max_scale) : "none");
  options.init_scale = scale;
  const ScaleRule rule = scale_rule_from(options);
  // "_growth_tracker", as torch.amp.GradScaler names it; states written
  // before this library used PyTorch's name say "growth_tracker".
  const bool old_name = state.count("_growth_tracker") == 0 && state.count("growth_tracker") != 0;
  const double tracker = get(old_name ? "growth_tracker" : "_growth_tracker");
  check(is_whole(tracker) && tracker >= 0, "GradScaler::load_state_dict: growth_tracker {} is not a count", tracker);
  // An update leaves the tracker below the interval (it grows and resets
  // there), and the scale inside this scaler's bounds.
  check(tracker < static_cast<double>(options.growth_interval),
        "GradScaler::load_state_dict: growth_tracker {} is not below growth_interval {}", tracker,
        options.growth_interval);
  double hysteresis = options_.hysteresis;
  if (auto it = state.find("hysteresis_left"); it != state.end()) hysteresis = it->second;
  check(is_whole(hysteresis) && hysteresis >= 0 && hysteresis <= options_.hysteresis,
        "GradScaler::load_state_dict: hysteresis_left {} is outside [0, {}]", hysteresis, options_.hysteresis);
  double step = static_cast<double>(step_);
  if (auto it = state.find("step"); it != state.end()) step = it->second;
  check(is_whole(step) && step >= 0, "GradScaler::load_state_dict: step {} is not a count", step);

  // Everything checked: now change state.
  options_.growth_factor = options.growth_factor;
  options_.backoff_factor = options.backoff_factor;
  options_.growth_interval = options.growth_interval;
  rule_ = rule;
  step_ = static_cast<int64_t>(step);
  pending_.scale = static_cast<float>(scale);
  pending_.growth_tracker = static_cast<int64_t>(tracker);
  pending_.hysteresis_left = static_cast<int32_t>(hysteresis);
  if (scale_.defined()) {
    prim::fill_(scale_, scale);
    prim::fill_(growth_tracker_, tracker);
    prim::fill_(hysteresis_left_, hysteresis);
  }
  per_optimizer_.clear();
}

std::string GradScaler::first_nonfinite_gradient(const std::vector<Tensor>& params) const {
  NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor g = params[i].grad();
    if (!g.defined()) continue;
    // x * 0 is 0 for finite x and NaN for inf/NaN: the sum is finite iff g is.
    const double probe = prim::sum(prim::mul_scalar(prim::to(g, DType::f32), 0.0)).item();
    if (!std::isfinite(probe)) return param_name(params[i], i);
  }
  return {};
}

double GradScaler::grad_norm(const std::vector<Tensor>& params) const {
  NoGradGuard no_grad;
  double sq = 0;
  for (const Tensor& p : params) {
    const Tensor g = p.grad();
    if (g.defined()) sq += prim::sum(prim::unary(UnaryOp::square, prim::to(g, DType::f32))).item();
  }
  return std::sqrt(sq);
}

}  // namespace mpt::amp
