#include "amp/fp8_scaling.h"

#include <algorithm>
#include <cmath>

#include "amp/amp_cuda.h"
#include "tensor/error.h"

namespace mpt::amp {

const char* fp8_scaling_mode_name(Fp8ScalingMode mode) {
  return mode == Fp8ScalingMode::delayed ? "delayed" : "current";
}

Fp8ScalingMode fp8_scaling_mode_from_name(const std::string& name) {
  if (name == "delayed") return Fp8ScalingMode::delayed;
  if (name == "current") return Fp8ScalingMode::current;
  throw ValueError(fmt::format("unknown FP8 recipe '{}' (delayed or current)", name));
}

void check_fp8_recipe(const Fp8Recipe& r) {
  check<ValueError>(r.history_length >= 1, "FP8 recipe: history length must be at least 1, got {}", r.history_length);
  check<ValueError>(std::isfinite(r.margin), "FP8 recipe: margin must be finite, got {}", r.margin);
}

DType fp8_format(Fp8Group group) { return group == Fp8Group::forward ? DType::e4m3 : DType::e5m2; }

Fp8Scaling::Fp8Scaling(const Fp8Recipe& recipe, const Device& device) : recipe_(recipe), device_(device) {
  check_fp8_recipe(recipe);
  for (Group& g : groups_) {
    g.amax = zeros({0}, DType::f32, device);
    g.history = zeros({0, recipe.history_length}, DType::f32, device);
    g.recorded = zeros({0}, DType::i64, device);
    g.scale = zeros({0}, DType::f32, device);
  }
}

float Fp8Scaling::target_max(Fp8Group group) const {
  return fp8_target_max(group == Fp8Group::forward ? kE4m3Max : kE5m2Max, recipe_.margin);
}

int64_t Fp8Scaling::add_slots(Fp8Group group, int64_t count) {
  check<ValueError>(count >= 0, "Fp8Scaling::add_slots: count must be non-negative, got {}", count);
  std::vector<std::string> names;
  for (int64_t i = 0; i < count; ++i)
    names.push_back(fmt::format("{}.{}", group == Fp8Group::forward ? "forward" : "backward", slots(group) + i));
  return add_slots(group, names);
}

const std::string& Fp8Scaling::slot_name(Fp8Group group, int64_t slot) const {
  const Group& g = groups_[index(group)];
  check<ValueError>(slot >= 0 && slot < g.slots, "Fp8Scaling::slot_name: slot {} out of range ({} slots)", slot,
                    g.slots);
  return g.names[static_cast<size_t>(slot)];
}

int64_t Fp8Scaling::add_slots(Fp8Group group, const std::vector<std::string>& names) {
  const auto count = static_cast<int64_t>(names.size());
  Group& g = groups_[index(group)];
  g.names.insert(g.names.end(), names.begin(), names.end());
  const int64_t first = g.slots;
  g.amax = prim::cat({g.amax, zeros({count}, DType::f32, device_)}, 0);
  g.history = prim::cat({g.history, zeros({count, recipe_.history_length}, DType::f32, device_)}, 0);
  g.recorded = prim::cat({g.recorded, zeros({count}, DType::i64, device_)}, 0);
  g.scale = prim::cat({g.scale, ones({count}, DType::f32, device_)}, 0);
  g.slots += count;
  return first;
}

prim::Fp8Quantized Fp8Scaling::quantize(Fp8Group group, int64_t slot, const Tensor& in, bool with_transpose,
                                        Fp8Prologue prologue, const Tensor& aux, bool column_sums) {
  Group& g = groups_[index(group)];
  check<ValueError>(slot >= 0 && slot < g.slots, "Fp8Scaling::quantize: slot {} out of range ({} slots in the {} group)",
                    slot, g.slots, group == Fp8Group::forward ? "forward" : "backward");
  check<DeviceError>(in.device() == device_, "Fp8Scaling::quantize: {} is not on the scaling state's device {}",
                     describe(in), device_.str());
  const bool current = recipe_.scaling == Fp8ScalingMode::current;
  if ((current || observer_) && prologue != Fp8Prologue::none)
    return quantize(group, slot, prim::fp8_prologue(prologue, in, aux), with_transpose, Fp8Prologue::none, Tensor(),
                    column_sums);
  Tensor scale = prim::slice(g.scale, 0, slot, slot + 1);
  const Tensor amax = prim::slice(g.amax, 0, slot, slot + 1);
  if (current) {
    const Tensor own = zeros({1}, DType::f32, device_);
    prim::amax_into(own, in);
    if (device_.is_cuda()) {
      cuda::fp8_current_scale(own, scale, target_max(group));
    } else {
      *scale.data<float>() = fp8_current_scale(*own.data<float>(), target_max(group));
    }
    scale.bump_version();
  }
  if (observer_) observer_(group, slot, in, scale);
  return prim::quantize_fp8(in, fp8_format(group), scale, amax, with_transpose, prologue, aux, column_sums);
}

void Fp8Scaling::update() {
  for (Fp8Group group : {Fp8Group::forward, Fp8Group::backward}) {
    Group& g = groups_[index(group)];
    if (g.slots == 0) continue;
    if (recipe_.scaling == Fp8ScalingMode::current) {
      prim::fill_(g.amax, 0.0);
      continue;
    }
    const DelayedScalingRule rule{target_max(group), recipe_.history_length, recipe_.reduction};
    if (device_.is_cuda()) {
      cuda::fp8_delayed_update(g.amax, g.history, g.recorded, g.scale, rule);
    } else {
      float* amax = g.amax.data<float>();
      float* history = g.history.data<float>();
      int64_t* recorded = g.recorded.data<int64_t>();
      float* scale = g.scale.data<float>();
      for (int64_t s = 0; s < g.slots; ++s) {
        update_delayed_scaling(rule, amax[s], {history + s * rule.history_length, recorded + s, scale + s});
        amax[s] = 0.0f;
      }
    }
    for (const Tensor* t : {&g.amax, &g.history, &g.recorded, &g.scale}) t->bump_version();
  }
}

std::vector<std::pair<std::string, Tensor>> Fp8Scaling::state() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (Fp8Group group : {Fp8Group::forward, Fp8Group::backward}) {
    const std::string prefix = group == Fp8Group::forward ? "forward." : "backward.";
    const Group& g = groups_[index(group)];
    out.emplace_back(prefix + "scale", g.scale);
    out.emplace_back(prefix + "amax", g.amax);
    out.emplace_back(prefix + "history", g.history);
    out.emplace_back(prefix + "recorded", g.recorded);
  }
  return out;
}

namespace {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

NamedTensors::const_iterator find_entry(const NamedTensors& state, const std::string& name) {
  return std::find_if(state.begin(), state.end(), [&](const auto& e) { return e.first == name; });
}

}  // namespace

void Fp8Scaling::check_state(const std::vector<std::pair<std::string, Tensor>>& state) const {
  const auto mine = this->state();
  check<ValueError>(state.size() == mine.size(), "FP8 scaling state: {} entries given, this run has {}", state.size(),
                    mine.size());
  for (const auto& [name, t] : mine) {
    const auto it = find_entry(state, name);
    check<ValueError>(it != state.end(), "FP8 scaling state: '{}' is missing", name);
    check<ValueError>(it->second.defined() && it->second.shape() == t.shape() && it->second.dtype() == t.dtype(),
                      "FP8 scaling state: '{}' is {}, this run's is {} (another model, or another history length?)",
                      name, it->second.defined() ? describe(it->second).str() : std::string("undefined"), describe(t));
  }
}

void Fp8Scaling::load_state(const std::vector<std::pair<std::string, Tensor>>& state) {
  check_state(state);
  for (const auto& [name, t] : this->state()) prim::copy_(t, find_entry(state, name)->second);
}

}  // namespace mpt::amp
