// amp's CUDA entry points in a build without CUDA.
#include "amp/amp_cuda.h"
#include "tensor/error.h"

namespace mpt::amp::cuda {

void unscale_and_check_inf(const std::vector<Tensor>& grads, Tensor& found_inf, const Tensor&) {
  throw NotAvailableError(fmt::format(
      "unscale_and_check_inf_: found_inf is on {}, but this build of mptrain has no CUDA support",
      found_inf.device().str()));
}

void update_scale(Tensor& scale, Tensor&, Tensor&, const Tensor&, const ScaleRule&, int64_t) {
  throw NotAvailableError(fmt::format(
      "GradScaler::update: the scale is on {}, but this build of mptrain has no CUDA support",
      scale.device().str()));
}

void fp8_delayed_update(Tensor& amax, Tensor&, Tensor&, Tensor&, const DelayedScalingRule&) {
  throw NotAvailableError(fmt::format("FP8 scaling: the state is on {}, but this build of mptrain has no CUDA support",
                                      amax.device().str()));
}

void fp8_current_scale(const Tensor& amax, Tensor&, float) {
  throw NotAvailableError(fmt::format("FP8 scaling: the state is on {}, but this build of mptrain has no CUDA support",
                                      amax.device().str()));
}

}  // namespace mpt::amp::cuda
