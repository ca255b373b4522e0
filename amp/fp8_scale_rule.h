#pragma once
// The per-tensor FP8 scaling rules, written once. As with the loss-scale
// rule (scale_rule.h), they are plain functions of plain data, so the CPU,
// a CUDA kernel (which keeps the histories on the GPU and in captured
// graphs) and the study tools run the very same code.
//
// A tensor quantized to FP8 is multiplied by its scale first, so that its
// largest magnitude (its amax) lands at the format's maximum, less a margin
// of 2^margin:
//
//   scale = (format_max / 2^margin) / amax
//
// current scaling: amax is the tensor's own, measured just before it is
// quantized (one more read of the tensor).
// delayed scaling (Transformer Engine's DelayedScaling): the scale used in
// a step comes from the amaxes recorded in earlier steps. Each tensor keeps
// the last `history_length` amaxes in a ring; after each step the newest
// is recorded and the scale recomputed from the history's maximum
// (AmaxReduction::max) or from the newest entry alone (most_recent).
//
// Edge cases, the same for both recipes:
// - an amax of 0 (an all-zero tensor) gives no information: current
//   scaling uses 1, delayed scaling keeps the scale it had;
// - a non-finite amax (an overflowing step, which the loss scaler skips)
//   is not recorded and leaves the scale as it was. Transformer Engine
//   records it, and with the max reduction an inf then pins the scale for
//   the whole history (1024 steps by default); a NaN it ignores;
// - an amax so small that the scale would overflow f32 gets f32's maximum.
#include <cmath>
#include <cstdint>

#include "amp/host_device.h"

namespace mpt::amp {

enum class AmaxReduction : int32_t { max = 0, most_recent = 1 };

// The largest finite magnitudes of the two FP8 formats.
inline constexpr float kE4m3Max = 448.0f;
inline constexpr float kE5m2Max = 57344.0f;

// The magnitude a scaled tensor's amax is placed at: the format's maximum
// less the margin, formed once on the host (in double, rounded to f32
// once) so every device scales with the same number.
inline float fp8_target_max(float format_max, float margin) {
  return static_cast<float>(static_cast<double>(format_max) * std::pow(2.0, -static_cast<double>(margin)));
}

// A scale for `amax`; `otherwise` where amax is 0 or not finite.
MPT_HOST_DEVICE inline float fp8_scale_for_amax(float amax, float target_max, float otherwise) {
  if (!(amax > 0.0f) || !(amax <= 3.4028235e38f)) return otherwise;  // 0, negative, inf or NaN
  const float scale = target_max / amax;
  return scale <= 3.4028235e38f ? scale : 3.4028235e38f;
}

// Current scaling: the scale for this step's own amax.
MPT_HOST_DEVICE inline float fp8_current_scale(float amax, float target_max) {
  return fp8_scale_for_amax(amax, target_max, 1.0f);
}

// Delayed scaling's constants.
struct DelayedScalingRule {
  float target_max = kE4m3Max;  // fp8_target_max(format's maximum, margin)
  int64_t history_length = 1024;  // >= 1
  AmaxReduction reduction = AmaxReduction::max;
};

// One tensor's delayed-scaling state. `history` holds history_length
// entries (0 where none was recorded yet); the newest amax is at
// (recorded - 1) % history_length.
struct DelayedScalingState {
  float* history = nullptr;
  int64_t* recorded = nullptr;  // amaxes recorded so far
  float* scale = nullptr;       // starts at 1
};

// Whether delayed scaling records an amax (inf and NaN it does not).
MPT_HOST_DEVICE inline bool fp8_amax_recordable(float amax) { return amax >= 0.0f && amax <= 3.4028235e38f; }

// The larger of `reduced` and the history entries begin, begin + step, ...
// (below history_length), leaving out `skip`: one reader's share of the max
// reduction (the GPU splits a history over a warp's lanes; the maximum does
// not depend on the order).
MPT_HOST_DEVICE inline float fp8_history_max(const float* history, int64_t history_length, int64_t begin,
                                             int64_t step, int64_t skip, float reduced) {
  for (int64_t i = begin; i < history_length; i += step)
    if (i != skip && history[i] > reduced) reduced = history[i];
  return reduced;
}

// Records a recordable amax in place of the oldest entry and recomputes the
// scale; `others_max` is the maximum of the other entries and the amax
// (fp8_history_max from the amax, skipping the entry replaced), read only
// under the max reduction.
MPT_HOST_DEVICE inline void record_delayed_amax(const DelayedScalingRule& rule, float amax, float others_max,
                                                DelayedScalingState s) {
  s.history[*s.recorded % rule.history_length] = amax;
  *s.recorded += 1;
  const float reduced = rule.reduction == AmaxReduction::max ? others_max : amax;
  *s.scale = fp8_scale_for_amax(reduced, rule.target_max, *s.scale);
}

// Records one step's amax and recomputes the scale from the history.
// Returns whether the amax was recorded (false for inf or NaN).
MPT_HOST_DEVICE inline bool update_delayed_scaling(const DelayedScalingRule& rule, float amax,
                                                   DelayedScalingState s) {
  if (!fp8_amax_recordable(amax)) return false;
  const int64_t n = rule.history_length;
  const float others_max =
      rule.reduction == AmaxReduction::max ? fp8_history_max(s.history, n, 0, 1, *s.recorded % n, amax) : amax;
  record_delayed_amax(rule, amax, others_max, s);
  return true;
}

}  // namespace mpt::amp
