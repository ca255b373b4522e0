// CPU-only builds: no fused optimizer kernels; the optimizers use raw ops.
#include "models/fused_optim.h"
#include "tensor/error.h"

namespace mpt::optim::fused {

bool available() { return false; }

void adamw(DType, const std::vector<AdamWTensor>&, const AdamWScalars&) {
  throw NotAvailableError("fused AdamW: this build of mptrain has no CUDA support");
}

void adamw_quantized(const AdamWTensor&, const QuantizedCopyTarget&, const AdamWScalars&) {
  throw NotAvailableError("fused AdamW: this build of mptrain has no CUDA support");
}

void advance_steps(const std::vector<float*>&, const float*) {
  throw NotAvailableError("fused AdamW: this build of mptrain has no CUDA support");
}

void sgd(DType, const std::vector<SGDTensor>&, const SGDScalars&) {
  throw NotAvailableError("fused SGD: this build of mptrain has no CUDA support");
}

}  // namespace mpt::optim::fused
