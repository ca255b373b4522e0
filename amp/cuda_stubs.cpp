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

}  // namespace mpt::amp::cuda
