#pragma once
// FP8 training's scaling state: each tensor that a product reads in FP8
// (a layer's input, its weight, the gradient of its output) has a slot
// holding its scale and, under delayed scaling, its amax history. The
// rules are fp8_scale_rule.h's; the state stays on the model's device, so
// a step needs no host sync and a captured step replays its updates.
//
// Formats are Transformer Engine's "HYBRID": the forward group (inputs and
// weights) in E4M3 (more precision, max 448), the backward group (output
// gradients) in E5M2 (more range, max 57344).
//
// Per step: quantize() each tensor as the layers run, then, once after the
// optimizer's step, update(). Between the two, amax(group) holds the
// step's running amaxes, to be all-reduced (max) across replicas first so
// that every replica derives the same scales.
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "amp/fp8_scale_rule.h"
#include "tensor/ops.h"
#include "tensor/tensor.h"

namespace mpt::amp {

enum class Fp8ScalingMode {
  delayed,  // the scale from earlier steps' amaxes (no extra pass over the tensor)
  current,  // the scale from the tensor's own amax, measured just before quantizing
};
const char* fp8_scaling_mode_name(Fp8ScalingMode mode);  // "delayed", "current"
Fp8ScalingMode fp8_scaling_mode_from_name(const std::string& name);

struct Fp8Recipe {
  Fp8ScalingMode scaling = Fp8ScalingMode::delayed;
  int64_t history_length = 1024;  // delayed only; >= 1
  AmaxReduction reduction = AmaxReduction::max;
  float margin = 0.0f;  // the scaled amax lands at the format's maximum / 2^margin
  // The forward products in the FP8 tensor cores' own accumulator
  // (cuBLASLt's fast accumulation, amp/fp8_linear.h says why); false:
  // promoted to f32 as the backward products are, slower. The CPU's
  // products are f32 either way.
  bool forward_fast_accumulation = true;
};
// ValueError naming the field for a history length below 1 or a margin
// that is not finite.
void check_fp8_recipe(const Fp8Recipe& recipe);

enum class Fp8Group : int { forward = 0, backward = 1 };
DType fp8_format(Fp8Group group);  // e4m3, e5m2

class Fp8Scaling {
 public:
  Fp8Scaling(const Fp8Recipe& recipe, const Device& device);

  const Fp8Recipe& recipe() const { return recipe_; }
  const Device& device() const { return device_; }
  // Adds a slot per name to `group` (scale 1, empty history), returning
  // the first one's index; earlier slots keep their state.
  int64_t add_slots(Fp8Group group, const std::vector<std::string>& names);
  int64_t add_slots(Fp8Group group, int64_t count);  // named "<group>.<index>"
  int64_t slots(Fp8Group group) const { return groups_[index(group)].slots; }
  const std::string& slot_name(Fp8Group group, int64_t slot) const;

  // Called by quantize() with each tensor and the scale (f32 [1]) it is
  // about to be quantized with: for tools that study the recipes
  // (fp8_stats.h). Reading either back waits for the device, so an
  // observed step is not one to capture in a CUDA graph.
  using Observer = std::function<void(Fp8Group group, int64_t slot, const Tensor& in, const Tensor& scale)>;
  void set_observer(Observer observer) { observer_ = std::move(observer); }
  bool observed() const { return static_cast<bool>(observer_); }

  // `in` [rows, cols] in the group's format with the slot's scale (current
  // scaling: from in's own amax first, kept as the slot's scale); in's
  // amax joins the slot's running amax. prologue, aux and column_sums as
  // prim::quantize_fp8's: `in` is then the prologue's result. Under
  // current scaling, or with an observer, that result is computed first by
  // its own pass (the scale and the observer need all of it before the
  // quantization starts); else the quantization applies it as it reads.
  prim::Fp8Quantized quantize(Fp8Group group, int64_t slot, const Tensor& in, bool with_transpose,
                              Fp8Prologue prologue = Fp8Prologue::none, const Tensor& aux = Tensor(),
                              bool column_sums = false);

  // Once per optimizer step: delayed scaling records each slot's running
  // amax in its history and recomputes its scale; both recipes then reset
  // the running amaxes to 0.
  void update();

  // The step's running amaxes, f32 [slots] (to all-reduce across replicas
  // before update()); the scales, f32 [slots]; the histories, f32 [slots,
  // history_length] (delayed only).
  Tensor& amax(Fp8Group group) { return groups_[index(group)].amax; }
  const Tensor& scale(Fp8Group group) const { return groups_[index(group)].scale; }
  const Tensor& history(Fp8Group group) const { return groups_[index(group)].history; }

  // Every state tensor by name ("forward.scale", "backward.history", ...).
  std::vector<std::pair<std::string, Tensor>> state() const;
  // ValueError naming the first entry that differs from this state's
  // (names, shapes, dtypes: another model, another history length).
  void check_state(const std::vector<std::pair<std::string, Tensor>>& state) const;
  // check_state(), then copies every entry.
  void load_state(const std::vector<std::pair<std::string, Tensor>>& state);

 private:
  struct Group {
    int64_t slots = 0;
    Tensor amax, history, recorded, scale;
    std::vector<std::string> names;
  };
  static int index(Fp8Group g) { return static_cast<int>(g); }
  float target_max(Fp8Group group) const;

  Fp8Recipe recipe_;
  Device device_;
  Group groups_[2];
  Observer observer_;
};

}  // namespace mpt::amp
