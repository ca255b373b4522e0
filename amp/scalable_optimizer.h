#pragma once
// What the loss scaler needs from an optimizer. amp/ sits below models/, so
// models::optim::Optimizer implements this interface rather than amp knowing
// the optimizers.
#include <vector>

#include "tensor/error.h"
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

  // Whether step_part() works, so the scaler can step the parameters whose
  // gradients are final while others are still arriving (LateGradients).
  virtual bool steps_in_parts() const { return false; }
  // As step_skipping_if(found_inf), or step() when found_inf is undefined,
  // for the parameters among `only` alone (the others and their step counts
  // are left as they are).
  virtual void step_part(const std::vector<Tensor>& only, const Tensor& found_inf) {
    (void)only;
    (void)found_inf;
    throw NotAvailableError("ScalableOptimizer::step_part: this optimizer steps all of its parameters at once");
  }
};

}  // namespace mpt::amp
