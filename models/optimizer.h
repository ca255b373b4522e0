#pragma once
// Optimizer: the part every update rule shares. It holds parameter groups
// (each with its own lr and weight decay, e.g. no decay for biases and
// norms), per-parameter state, zero_grad(), and a flat state dict.
//
// step() collects, per group, the parameters that have a gradient (cast to
// the parameter's dtype: 16-bit gradients update f32 master weights) and
// hands the whole batch to update_group(). A rule is written per group, not
// per parameter, so a multi-tensor or fused kernel can later replace the
// loop inside one override without touching the bookkeeping here.
//
// State dict scheme (one flat name -> Tensor map, so a checkpoint writer
// needs to know only tensors; scalars are 0-d CPU tensors):
//   "group.<g>.lr"            f64 0-d   learning rate of group g
//   "group.<g>.weight_decay"  f64 0-d   weight decay of group g
//   "state.<i>.step"          i64 0-d   updates parameter i has received
//   "state.<i>.<buffer>"      tensor    e.g. exp_avg, exp_avg_sq, momentum_buffer
// <g> counts groups from 0; <i> counts parameters from 0 across the groups
// in order (PyTorch's numbering). Only parameters that have state appear.
// Other hyper-parameters (momentum, betas, eps) belong to the constructor
// and are not saved. The buffers are the live tensors; clone to snapshot.
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "amp/scalable_optimizer.h"
#include "models/ordered_dict.h"
#include "tensor/tensor.h"

namespace mpt::amp {
struct Fp8LinearState;
}

namespace mpt::optim {

using StateDict = OrderedDict<Tensor>;

// Parameters sharing hyper-parameters. Unset values take the optimizer's.
struct ParamGroup {
  std::vector<Tensor> params;
  std::optional<double> lr;
  std::optional<double> weight_decay;
};

// What the optimizer remembers about one parameter.
struct ParamState {
  int64_t step = 0;               // updates applied to this parameter (see device_step)
  OrderedDict<Tensor> buffers;    // rule-specific: exp_avg, momentum_buffer, ...
  // Capturable mode: the count lives here (f32 [1] on the parameter's
  // device) and `step` is only its value when the mode began.
  Tensor device_step;
};

// One parameter taking part in this step.
struct ParamUpdate {
  Tensor param;
  Tensor grad;        // in param's dtype and on its device; do not modify (it may be param.grad())
  ParamState* state;  // step already incremented for this update
  size_t index;       // global parameter index (the <i> of the state dict)
};

// A ScalableOptimizer, so amp::GradScaler can unscale its gradients and skip
// its step; the skip decision is read on the host (the default).
class Optimizer : public amp::ScalableOptimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One update of every parameter that has a gradient; the others (and
  // their step counts) are left alone. Runs without recording autograd.
  void step() override;
  // Drops every parameter's gradient (undefined, not zero-filled).
  void zero_grad();
  // Every parameter, by global index (what the loss scaler unscales).
  std::vector<Tensor> scalable_parameters() const override { return all_params_; }

  const std::string& name() const { return name_; }
  size_t num_groups() const { return groups_.size(); }
  const std::vector<Tensor>& group_params(size_t g) const { return groups_.at(g).params; }
  double lr(size_t g = 0) const { return groups_.at(g).lr; }
  // The group's lr when the optimizer was made (what a schedule scales).
  double initial_lr(size_t g = 0) const { return groups_.at(g).initial_lr; }
  double weight_decay(size_t g = 0) const { return groups_.at(g).weight_decay; }
  void set_lr(double lr);             // every group
  void set_lr(size_t g, double lr);   // one group
  size_t num_params() const { return states_.size(); }
  const ParamState& state(size_t index) const { return states_.at(index); }
  // Updates parameter `index` has received (in capturable mode a read from
  // the device, so one synchronization).
  int64_t step_count(size_t index) const;

  // Capturable mode (PyTorch's `capturable`): step counts live on the device
  // and a loss scaler's skip decision is read there, so a step needs no host
  // synchronization and can be recorded in a CUDA graph (CapturedStep). The
  // learning rate and weight decay are read there too: set_lr() between the
  // replays of a captured step (a schedule) takes effect without capturing
  // again; called inside the step, its value is captured with it.
  // Needs a rule with a device-step kernel (AdamW, SGD), fusion on, and every
  // parameter a contiguous f32/f16/bf16 tensor on one CUDA device; otherwise
  // ValueError names what is missing. Turning it off brings the counts back.
  void set_capturable(bool capturable);
  bool capturable() const { return capturable_; }
  bool skips_on_device() const override { return capturable_; }
  void step_skipping_if(const Tensor& found_inf) override;
  bool steps_in_parts() const override { return true; }
  void step_part(const std::vector<Tensor>& only, const Tensor& found_inf) override;

  // FP8 training (train::MixedPrecision): asks the step to write `layer`'s
  // weight copies (amp::Fp8LinearState) from `param`, its weight, in the
  // pass that updates it where the rule has one (AdamW's fused CUDA step),
  // so that the f32 weight is read once a step instead of twice. Returns
  // whether it will; where not, the layer makes them at its next forward,
  // as it does for any step that did not write them. The copies take the
  // scale the layer's slot holds when the step runs: delayed scaling's
  // update() comes first.
  virtual bool write_fp8_copies(const Tensor& /*param*/, std::shared_ptr<amp::Fp8LinearState> /*layer*/) {
    return false;
  }

  // On by default: on CUDA a group updates in one multi-tensor kernel, on the
  // CPU in one loop per parameter (models/fused_optim.h), wherever it is
  // f32, f16 or bf16; off, every device uses the raw-op rule (for
  // comparisons).
  void set_fused(bool fused) { fused_ = fused; }
  bool fused() const { return fused_; }

  StateDict state_dict() const;
  // Checks every key, shape and group count first; a bad dict changes
  // nothing. Buffers are copied onto each parameter's device and dtype.
  void load_state_dict(const StateDict& dict);

 protected:
  struct Group {
    std::vector<Tensor> params;
    double lr = 0;
    double initial_lr = 0;
    double weight_decay = 0;
    size_t first_index = 0;  // global index of params[0]
    // Capturable mode: {lr, 1 - lr * weight_decay, weight_decay} as f32 [3]
    // on the parameters' device (fused::HyperSlot), written (on the current
    // stream) at every change, so a rule's kernel reads them there and a
    // replayed graph follows a schedule.
    Tensor hyper_on_device;
  };

  Optimizer(std::string name, std::vector<ParamGroup> groups, double default_lr, double default_weight_decay);

  // Applies the rule to every parameter of `batch` (all of group `group`).
  virtual void update_group(const Group& group, std::vector<ParamUpdate>& batch) = 0;
  // Called by step() after update_group(batch) and the versions' bump.
  virtual void after_update(const std::vector<ParamUpdate>& batch) { (void)batch; }
  // Names of the per-parameter buffers the rule keeps (for load checks).
  virtual std::vector<std::string> buffer_names() const = 0;
  // Whether a parameter's first update makes its buffers, so that a state
  // of one or more steps without them is another optimizer's (SGD without
  // momentum keeps none).
  virtual bool steps_make_buffers() const { return true; }
  // Whether update_group() handles capturable mode: counts in
  // ParamState::device_step (advanced by the rule, unless found_inf()), the
  // step skipped on the device when found_inf() is set.
  virtual bool has_device_steps() const { return false; }
  // The scaler's overflow flag during step_skipping_if(), else undefined.
  const Tensor& found_inf() const { return found_inf_; }

  // "blocks.0.attn.qkv.weight" when the module named it, else "param <i>".
  std::string param_name(size_t index) const;
  void check_lr(double lr, size_t g) const;
  // What step() refuses before changing anything: a gradient that does not
  // fit its parameter, state on another device than the parameter.
  void check_update(size_t index, const Tensor& p, const Tensor& g) const;
  // Capturable mode: group g's lr and weight decay written to its
  // hyper_on_device (made on first use; the weight decay's own slot only
  // when `weight_decay_too`, since set_lr() leaves it); otherwise nothing.
  void write_hyper_to_device(size_t g, bool weight_decay_too = true);
  // Whether `batch` can go to a fused update: fusion on, every parameter and
  // gradient contiguous, on one device (the CPU, or CUDA in a build with
  // it), in one dtype of f32/f16/bf16.
  bool can_fuse(const std::vector<ParamUpdate>& batch) const;

 private:
  std::string name_;
  std::vector<Group> groups_;
  std::vector<ParamState> states_;   // one per parameter, by global index
  std::vector<Tensor> all_params_;   // by global index
  bool capturable_ = false;
  Tensor found_inf_;
  // During step_part(): the data of the parameters taking part (null: all).
  const std::unordered_set<const void*>* part_ = nullptr;
  bool fused_ = true;
};

}  // namespace mpt::optim
