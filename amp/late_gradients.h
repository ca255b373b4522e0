#pragma once
// Gradients that are not final when backward returns. A data-parallel
// wrapper that overlaps its last all-reduce with the optimizer step
// (DistributedDataParallel::overlap_step_with) hands them to the loss
// scaler, which steps the other parameters while they travel and these
// once they have arrived, on one decision for both.
#include <functional>
#include <optional>
#include <vector>

#include "tensor/tensor.h"

namespace mpt::amp {

struct LateGradients {
  std::vector<Tensor> params;  // whose gradients become final with wait()
  // f32 [1] on the gradients' device, nonzero when any of them holds inf or
  // NaN (on any rank); valid once wait_for_check() has run.
  Tensor nonfinite;
  std::function<void()> wait_for_check;  // the current stream (or, on the CPU, the host) waits for `nonfinite`
  std::function<void()> wait;            // ... for the final gradients
};

// Called by the scaler at each unscale_/step: the late gradients of the
// last backward, once (nullopt when there are none).
using LateGradientSource = std::function<std::optional<LateGradients>()>;

}  // namespace mpt::amp
