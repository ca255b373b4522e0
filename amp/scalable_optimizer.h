#pragma once
// What the loss scaler needs from an optimizer. amp/ sits below models/, so
// models::optim::Optimizer implements this interface rather than amp knowing
// the optimizers.
#include <vector>

#include "tensor/tensor.h"

namespace mpt::amp {

class ScalableOptimizer {
 public:
  virtual ~ScalableOptimizer() = default;

  // The parameters whose .grad the scaler unscales and checks, in a stable
  // order (the first non-finite one is reported by name).
  virtual std::vector<Tensor> scalable_parameters() const = 0;
  // One ordinary update.
  virtual void step() = 0;

  // True when step_skipping_if decides on the device (a fused kernel that
  // reads found_inf itself and leaves the parameters alone when it is set):
  // then a scaler step needs no host sync at all. GradScaler calls
  // step_skipping_if only then; otherwise it reads found_inf (with the scale,
  // in one sync) and calls step() itself.
  virtual bool skips_on_device() const { return false; }
  // Updates unless found_inf (f32 [1], nonzero: skip) says otherwise. The
  // default reads found_inf on the host (one sync) and calls step().
  virtual void step_skipping_if(const Tensor& found_inf) {
    if (found_inf.item() == 0.0) step();
  }
};

}  // namespace mpt::amp
