#pragma once
// The loss-scale update rule of every policy, written once. It is a plain
// function of plain data so the CPU path, a one-thread CUDA kernel (which
// keeps the scale on the GPU: no host sync per step) and the replay tool all
// run the very same code.
//
// One update after each optimizer step, given whether any gradient was
// inf/NaN (found_inf) and how many growth units the step counted (1 for
// optimizer steps; the number of micro-batches or samples otherwise):
//
// torch (PyTorch's GradScaler, exactly, when min/max are left open):
//   found_inf: scale = max(scale * backoff, min_scale); tracker = 0
//   (products in double, rounded to f32 once, as PyTorch's kernels do)
//   else:      tracker += units; if tracker >= growth_interval:
//                grown = scale * growth; if grown is finite: scale = min(grown, max_scale)
//                tracker = 0
// hysteresis (Megatron-LM / DeepSpeed): tolerate `hysteresis` overflows
// before backing off.
//   found_inf: tracker = 0; hysteresis_left = max(hysteresis_left - 1, 0)
//              if hysteresis_left == 0: scale = max(scale * backoff, min_scale)
//   else:      if consecutive_hysteresis: hysteresis_left = hysteresis
//              tracker += units; if tracker >= growth_interval:
//                grow as torch does; tracker = 0; hysteresis_left = hysteresis
//   (hysteresis = 1 behaves as torch.)
// static: the scale never changes (overflowing steps are still skipped).
#include <cstdint>

#include "amp/host_device.h"

namespace mpt::amp {

enum class ScalePolicy : int32_t { torch = 0, hysteresis = 1, fixed = 2 };  // fixed: "static"

// The rule's constants (all policies; each reads what it needs).
struct ScaleRule {
  ScalePolicy policy = ScalePolicy::torch;
  // Doubles, as PyTorch's update kernels take them: the product with the
  // f32 scale is formed in double and rounded to f32 once, so a factor
  // such as 0.8, which f32 cannot hold, gives PyTorch's scales.
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  float min_scale = 0.0f;             // floor for back-off (0: none)
  float max_scale = 3.4028235e38f;    // cap for growth (f32 max: none)
  int32_t hysteresis = 2;
  bool consecutive_hysteresis = false;
};

// What changes from step to step. Lives on the scale's device as tensors;
// this struct is the host-side view of one set of values.
struct ScaleState {
  float scale = 65536.0f;
  int64_t growth_tracker = 0;
  int32_t hysteresis_left = 2;
};

MPT_HOST_DEVICE inline float scale_after_backoff(const ScaleRule& rule, float scale) {
  const auto reduced = static_cast<float>(static_cast<double>(scale) * rule.backoff_factor);
  return reduced < rule.min_scale ? rule.min_scale : reduced;
}

MPT_HOST_DEVICE inline float scale_after_growth(const ScaleRule& rule, float scale) {
  const auto grown = static_cast<float>(static_cast<double>(scale) * rule.growth_factor);
  if (!(grown <= 3.4028235e38f)) return scale;  // never past the f32 maximum (false for inf and NaN)
  return grown > rule.max_scale ? (scale > rule.max_scale ? scale : rule.max_scale) : grown;
}

// Applies one step's outcome to (scale, growth_tracker, hysteresis_left).
MPT_HOST_DEVICE inline void update_scale(const ScaleRule& rule, bool found_inf, int64_t units, float* scale,
                                         int64_t* growth_tracker, int32_t* hysteresis_left) {
  switch (rule.policy) {
    case ScalePolicy::fixed: return;
    case ScalePolicy::torch:
      if (found_inf) {
        *scale = scale_after_backoff(rule, *scale);
        *growth_tracker = 0;
        return;
      }
      break;
    case ScalePolicy::hysteresis:
      if (found_inf) {
        *growth_tracker = 0;
        *hysteresis_left = *hysteresis_left > 0 ? *hysteresis_left - 1 : 0;
        if (*hysteresis_left == 0) *scale = scale_after_backoff(rule, *scale);
        return;
      }
      if (rule.consecutive_hysteresis) *hysteresis_left = rule.hysteresis;
      break;
  }
  *growth_tracker += units;
  if (*growth_tracker >= rule.growth_interval) {
    *scale = scale_after_growth(rule, *scale);
    *growth_tracker = 0;
    if (rule.policy == ScalePolicy::hysteresis) *hysteresis_left = rule.hysteresis;
  }
}

inline void update_scale(const ScaleRule& rule, bool found_inf, int64_t units, ScaleState& state) {
  update_scale(rule, found_inf, units, &state.scale, &state.growth_tracker, &state.hysteresis_left);
}

}  // namespace mpt::amp
