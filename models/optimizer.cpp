#include "models/optimizer.h"

#include <algorithm>
#include <cmath>
#include <unordered_set>

#include "autograd/grad_mode.h"
#include "models/fused_optim.h"
#include "tensor/ops.h"

namespace mpt::optim {
namespace {

// 2^53: a larger double is no exact count, and past 2^63 converting it to
// int64 is undefined.
constexpr double kMaxExactCount = 9007199254740992.0;

// "state.12.exp_avg" -> {"state", "12", "exp_avg"}; empty when not three parts.
std::vector<std::string> split_key(const std::string& key) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t dot = key.find('.', start);
    parts.push_back(key.substr(start, dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  if (parts.size() != 3) parts.clear();
  return parts;
}

std::optional<size_t> parse_index(const std::string& s) {
  if (s.empty() || s.size() > 18) return std::nullopt;
  size_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + static_cast<size_t>(c - '0');
  }
  return v;
}

bool is_host_scalar(const Tensor& t) { return t.defined() && t.numel() == 1; }

}  // namespace

Optimizer::Optimizer(std::string name, std::vector<ParamGroup> groups, double default_lr, double default_wd)
    : name_(std::move(name)) {
  check(!groups.empty(), "{}: no parameter groups given", name_);
  std::unordered_set<const TensorImpl*> seen;
  for (size_t g = 0; g < groups.size(); ++g) {
    ParamGroup& in = groups[g];
    check(!in.params.empty(), "{}: parameter group {} is empty", name_, g);
    Group out;
    out.lr = in.lr.value_or(default_lr);
    out.initial_lr = out.lr;
    out.weight_decay = in.weight_decay.value_or(default_wd);
    check_lr(out.lr, g);
    check(std::isfinite(out.weight_decay) && out.weight_decay >= 0,
          "{}: invalid weight_decay {} for group {} (must be >= 0)", name_, out.weight_decay, g);
    out.first_index = all_params_.size();
    for (const Tensor& p : in.params) {
      const size_t i = all_params_.size();
      check(p.defined(), "{}: parameter {} (group {}) is an undefined tensor", name_, i, g);
      check<DTypeError>(is_floating(p.dtype()) && !is_float8(p.dtype()),
                        "{}: parameter {} must be f32, f16, bf16 or f64, got {}", name_, i, describe(p));
      // Updating one tensor twice per step is always a bug (tied weights
      // must be passed once; Module::parameters() does that).
      check(seen.insert(p.impl_ptr().get()).second, "{}: parameter {} ('{}') appears more than once", name_, i,
            p.impl_ptr()->autograd ? p.autograd_meta().name : std::string());
      all_params_.push_back(p);
      out.params.push_back(p);
    }
    groups_.push_back(std::move(out));
  }
  states_.resize(all_params_.size());
}

std::string Optimizer::param_name(size_t index) const {
  const Tensor& p = all_params_.at(index);
  if (p.impl_ptr()->autograd && !p.autograd_meta().name.empty()) return p.autograd_meta().name;
  return fmt::format("param {}", index);
}

void Optimizer::check_lr(double lr, size_t g) const {
  check(std::isfinite(lr) && lr >= 0, "{}: invalid learning rate {} for group {} (must be >= 0)", name_, lr, g);
}

bool Optimizer::can_fuse(const std::vector<ParamUpdate>& batch) const {
  if (!fused_ || batch.empty()) return false;
  const Device device = batch.front().param.device();
  const DType dtype = batch.front().param.dtype();
  // f64 stays with the raw ops: the fused rules compute in f32.
  if ((device.is_cuda() && !fused::available()) || (dtype != DType::f32 && dtype != DType::f16 && dtype != DType::bf16))
    return false;
  for (const ParamUpdate& u : batch)
    if (u.param.device() != device || u.param.dtype() != dtype || !u.param.is_contiguous() ||
        !u.grad.is_contiguous())
      return false;
  return true;
}

void Optimizer::set_lr(double lr) {
  for (size_t g = 0; g < groups_.size(); ++g) set_lr(g, lr);
}

void Optimizer::set_lr(size_t g, double lr) {
  check(g < groups_.size(), "{}: set_lr: no group {} (there are {})", name_, g, groups_.size());
  check_lr(lr, g);
  groups_[g].lr = lr;
  write_hyper_to_device(g, /*weight_decay_too=*/false);
}

void Optimizer::write_hyper_to_device(size_t g, bool weight_decay_too) {
  Group& group = groups_[g];
  if (!capturable_) {
    group.hyper_on_device = Tensor();
    return;
  }
  // Fill kernels, not copies from the host: stream-ordered with the replays,
  // and allowed inside a capture. The values are the floats the host passes
  // to the kernels outside capturable mode.
  if (!group.hyper_on_device.defined()) {
    group.hyper_on_device = Tensor::empty({3}, DType::f32, all_params_.front().device());
    weight_decay_too = true;
  }
  auto write = [&](fused::HyperSlot slot, double value) {
    prim::fill_(prim::slice(group.hyper_on_device, 0, slot, slot + 1), static_cast<float>(value));
  };
  write(fused::kLr, group.lr);
  write(fused::kDecay, 1.0 - group.lr * group.weight_decay);
  if (weight_decay_too) write(fused::kWeightDecay, group.weight_decay);
}

void Optimizer::zero_grad() {
  for (Tensor& p : all_params_) p.set_grad(Tensor());
}

// Called for every parameter at every eager step: the messages are made
// only for a failure.
void Optimizer::check_update(size_t index, const Tensor& p, const Tensor& g) const {
  if (g.shape() != p.shape())
    throw ShapeError(fmt::format("{}: gradient {} of '{}' does not match the parameter {}", name_, describe(g),
                                 param_name(index), describe(p)));
  if (g.device() != p.device())
    throw DeviceError(fmt::format("{}: gradient {} of '{}' is not on the parameter's device ({})", name_, describe(g),
                                  param_name(index), describe(p)));
  // The kernels take the state's memory as it is: state left on another
  // device (a module moved after its optimizer stepped or loaded) would be
  // read there, as an illegal address on a GPU.
  const ParamState& state = states_[index];
  for (const auto& [key, buffer] : state.buffers)
    if (buffer.device() != p.device())
      throw DeviceError(fmt::format(
          "{}: the state '{}' of '{}' is on {}, but the parameter is on {}; a module moved after its optimizer "
          "stepped or loaded its state leaves that state behind (move the module first, or make a new optimizer)",
          name_, key, param_name(index), buffer.device().str(), p.device().str()));
  if (state.device_step.defined() && state.device_step.device() != p.device())
    throw DeviceError(fmt::format("{}: the step count of '{}' is on {}, but the parameter is on {}", name_,
                                  param_name(index), state.device_step.device().str(), p.device().str()));
}

void Optimizer::step() {
  NoGradGuard no_grad;
  // Everything is checked before anything changes: a refused step leaves
  // every parameter and its state as they were.
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const Group& group = groups_[gi];
    for (size_t j = 0; j < group.params.size(); ++j) {
      const Tensor& p = group.params[j];
      if (p.grad().defined() && !(part_ && !part_->count(p.data_ptr())))
        check_update(group.first_index + j, p, p.grad());
    }
    if (group.hyper_on_device.defined() && !group.params.empty() &&
        group.hyper_on_device.device() != group.params.front().device())
      throw DeviceError(fmt::format("{}: group {}'s learning rate is on {}, but its parameters are on {} (make the "
                                    "optimizer after moving the module)",
                                    name_, gi, group.hyper_on_device.device().str(),
                                    group.params.front().device().str()));
  }
  std::vector<ParamUpdate> batch;
  for (const Group& group : groups_) {
    batch.clear();
    for (size_t j = 0; j < group.params.size(); ++j) {
      const Tensor& p = group.params[j];
      Tensor g = p.grad();
      if (!g.defined() || (part_ && !part_->count(p.data_ptr()))) continue;
      const size_t index = group.first_index + j;
      // Mixed precision: 16-bit gradients update f32 master weights.
      if (g.dtype() != p.dtype()) g = prim::to(g, p.dtype());
      ParamState& state = states_[index];
      if (capturable_) {
        g = prim::contiguous(g);
        if (!state.device_step.defined())
          state.device_step = full({1}, static_cast<double>(state.step), DType::f32, p.device());
      } else {
        ++state.step;
      }
      batch.push_back(ParamUpdate{p, g, &state, index});
    }
    if (!batch.empty()) update_group(group, batch);
    // The rules write through their own kernels: the versions say so, for
    // autograd's saved tensors and autocast's cached casts.
    for (const ParamUpdate& u : batch) u.param.bump_version();
    if (!batch.empty()) after_update(batch);
  }
}

void Optimizer::step_skipping_if(const Tensor& found_inf) {
  if (!capturable_) {
    ScalableOptimizer::step_skipping_if(found_inf);
    return;
  }
  check<DeviceError>(found_inf.device() == all_params_.front().device() && found_inf.dtype() == DType::f32 &&
                         found_inf.numel() == 1,
                     "{}: step_skipping_if: found_inf must be f32 [1] on {}, got {}", name_,
                     all_params_.front().device().str(), describe(found_inf));
  found_inf_ = found_inf;
  try {
    step();
  } catch (...) {
    found_inf_ = Tensor();
    throw;
  }
  found_inf_ = Tensor();
}

void Optimizer::step_part(const std::vector<Tensor>& only, const Tensor& found_inf) {
  std::unordered_set<const void*> part;
  for (const Tensor& p : only) part.insert(p.data_ptr());
  part_ = &part;
  try {
    if (found_inf.defined()) step_skipping_if(found_inf);
    else step();
  } catch (...) {
    part_ = nullptr;
    throw;
  }
  part_ = nullptr;
}

void Optimizer::set_capturable(bool capturable) {
  if (capturable == capturable_) return;
  if (capturable) {
    check(has_device_steps(),
          "{}: capturable mode needs a rule with device-side step counts (AdamW and SGD have them)", name_);
    check(fused_ && fused::available(), "{}: capturable mode needs the fused CUDA kernels (fusion is off or not built)",
          name_);
    const Device device = all_params_.front().device();
    for (size_t i = 0; i < all_params_.size(); ++i) {
      const Tensor& p = all_params_[i];
      check<DeviceError>(p.device().is_cuda() && p.device() == device,
                         "{}: capturable mode needs every parameter on one CUDA device; '{}' is {} (first: {})", name_,
                         param_name(i), describe(p), device.str());
      check<DTypeError>((p.dtype() == DType::f32 || p.dtype() == DType::f16 || p.dtype() == DType::bf16) &&
                            p.is_contiguous(),
                        "{}: capturable mode needs contiguous f32/f16/bf16 parameters; '{}' is {}", name_,
                        param_name(i), describe(p));
    }
  } else {
    for (ParamState& s : states_) {
      if (s.device_step.defined()) s.step = static_cast<int64_t>(s.device_step.item());
      s.device_step = Tensor();
    }
  }
  capturable_ = capturable;
  for (size_t g = 0; g < groups_.size(); ++g) write_hyper_to_device(g);
}

int64_t Optimizer::step_count(size_t index) const {
  const ParamState& s = states_.at(index);
  return s.device_step.defined() ? static_cast<int64_t>(s.device_step.item()) : s.step;
}

// ---- state dict -------------------------------------------------------------------------

StateDict Optimizer::state_dict() const {
  StateDict out;
  for (size_t g = 0; g < groups_.size(); ++g) {
    out.insert(fmt::format("group.{}.lr", g), scalar_tensor(groups_[g].lr, DType::f64));
    out.insert(fmt::format("group.{}.weight_decay", g), scalar_tensor(groups_[g].weight_decay, DType::f64));
  }
  for (size_t i = 0; i < states_.size(); ++i) {
    const ParamState& s = states_[i];
    const int64_t step = step_count(i);
    if (step == 0 && s.buffers.empty()) continue;
    out.insert(fmt::format("state.{}.step", i), scalar_tensor(static_cast<double>(step), DType::i64));
    for (const auto& [name, t] : s.buffers) out.insert(fmt::format("state.{}.{}", i, name), t);
  }
  return out;
}

void Optimizer::load_state_dict(const StateDict& dict) {
  const std::vector<std::string> buffers = buffer_names();
  std::vector<std::string> problems;
  std::vector<bool> group_lr(groups_.size()), group_wd(groups_.size());
  // Per parameter: whether its step and how many of its buffers came, so a
  // state cut short is refused here and not found missing mid-step.
  std::vector<bool> has_step(all_params_.size());
  std::vector<size_t> buffers_given(all_params_.size());

  for (const auto& [key, t] : dict) {
    const std::vector<std::string> parts = split_key(key);
    const std::optional<size_t> index = parts.empty() ? std::nullopt : parse_index(parts[1]);
    if (!index || (parts[0] != "group" && parts[0] != "state")) {
      problems.push_back(fmt::format("unexpected key '{}'", key));
      continue;
    }
    if (!t.defined()) {
      problems.push_back(fmt::format("key '{}' holds an undefined tensor", key));
      continue;
    }
    if (parts[0] == "group") {
      if (*index >= groups_.size()) {
        problems.push_back(fmt::format("key '{}': this optimizer has {} group(s)", key, groups_.size()));
      } else if (parts[2] != "lr" && parts[2] != "weight_decay") {
        problems.push_back(fmt::format("unexpected key '{}'", key));
      } else if (!is_host_scalar(t)) {
        problems.push_back(fmt::format("key '{}' must be a scalar, got {}", key, describe(t)));
      } else {
        (parts[2] == "lr" ? group_lr : group_wd)[*index] = true;
      }
      continue;
    }
    if (*index >= all_params_.size()) {
      problems.push_back(fmt::format("key '{}': this optimizer has {} parameter(s)", key, all_params_.size()));
    } else if (parts[2] == "step") {
      if (!is_host_scalar(t)) problems.push_back(fmt::format("key '{}' must be a scalar, got {}", key, describe(t)));
      has_step[*index] = true;
    } else if (std::find(buffers.begin(), buffers.end(), parts[2]) == buffers.end()) {
      problems.push_back(fmt::format("unexpected key '{}' ({} keeps no '{}' buffer)", key, name_, parts[2]));
    } else if (t.shape() != all_params_[*index].shape() || !is_floating(t.dtype()) || is_float8(t.dtype())) {
      problems.push_back(fmt::format("key '{}': {} does not fit parameter '{}' {}", key, describe(t),
                                     param_name(*index), describe(all_params_[*index])));
    } else {
      ++buffers_given[*index];
    }
  }
  for (size_t i = 0; i < all_params_.size(); ++i) {
    // All of a parameter's buffers or none (none: made afresh at its next
    // step), and with any of them its step count.
    if (buffers_given[i] != 0 && buffers_given[i] != buffers.size())
      problems.push_back(fmt::format("state of parameter {} ('{}') holds {} of the buffers {}", i, param_name(i),
                                     buffers_given[i], fmt::join(buffers, ", ")));
    if (buffers_given[i] != 0 && !has_step[i])
      problems.push_back(fmt::format("missing key 'state.{}.step' beside the buffers of parameter '{}'", i,
                                     param_name(i)));
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (!group_lr[g]) problems.push_back(fmt::format("missing key 'group.{}.lr'", g));
    if (!group_wd[g]) problems.push_back(fmt::format("missing key 'group.{}.weight_decay'", g));
  }
  if (!problems.empty()) {
    std::string msg = fmt::format("{}.load_state_dict: {} problem{}, nothing was loaded:", name_, problems.size(),
                                  problems.size() == 1 ? "" : "s");
    for (const std::string& p : problems) msg += "\n  " + p;
    throw ValueError(msg);
  }

  // Validate the values too before touching anything.
  std::vector<Group> groups = groups_;
  for (size_t g = 0; g < groups.size(); ++g) {
    groups[g].lr = dict.at(fmt::format("group.{}.lr", g)).item();
    groups[g].weight_decay = dict.at(fmt::format("group.{}.weight_decay", g)).item();
    check_lr(groups[g].lr, g);
    check(std::isfinite(groups[g].weight_decay) && groups[g].weight_decay >= 0,
          "{}.load_state_dict: invalid weight_decay {} for group {}", name_, groups[g].weight_decay, g);
  }
  std::vector<ParamState> states(all_params_.size());
  NoGradGuard no_grad;
  for (const auto& [key, t] : dict) {
    const std::vector<std::string> parts = split_key(key);
    if (parts[0] != "state") continue;
    const size_t i = *parse_index(parts[1]);
    if (parts[2] == "step") {
      const double step = t.item();
      check(step >= 0 && step == std::floor(step) && step <= kMaxExactCount,
            "{}.load_state_dict: '{}' must be a count (0 to 2^53), got {}", name_, key, step);
      states[i].step = static_cast<int64_t>(step);
    } else {
      // A private copy on the parameter's device and dtype: updates are in
      // place and must not write into the caller's dict.
      const Tensor& p = all_params_[i];
      Tensor b = Tensor::empty(p.shape(), p.dtype(), p.device());
      prim::copy_(b, t);
      states[i].buffers.insert(parts[2], b);
    }
  }
  // Steps taken without the buffers they make: restarting the moments from
  // zero under a bias correction for many steps would scale the next
  // updates wrongly (AdamW's by about 3 at the defaults).
  for (size_t i = 0; i < states.size(); ++i)
    check(!steps_make_buffers() || states[i].step == 0 || !states[i].buffers.empty(),
          "{}.load_state_dict: parameter {} ('{}') took {} steps, but the state holds none of its buffers ({}): a "
          "state of another optimizer? Nothing was loaded",
          name_, i, param_name(i), states[i].step, fmt::join(buffer_names(), ", "));
  groups_ = std::move(groups);
  states_ = std::move(states);
  for (size_t g = 0; g < groups_.size(); ++g) write_hyper_to_device(g);
}

}  // namespace mpt::optim
