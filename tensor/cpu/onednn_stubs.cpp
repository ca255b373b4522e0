// Builds without oneDNN (CMake did not find libdnnl-dev 2.x, or
// MPT_WITH_ONEDNN=OFF): every product goes to Eigen.
#include "tensor/cpu/onednn_matmul.h"

namespace mpt::cpu {

bool onednn_matmul(const TensorView&, const TensorView&, const TensorView&, const TensorView&) { return false; }
bool onednn_chosen(DType, DType, int64_t, int64_t, int64_t, int64_t) { return false; }
bool onednn_built() { return false; }
bool onednn_usable(std::string* reason) {
  if (reason != nullptr) *reason = "this build of mptrain has no oneDNN (libdnnl-dev 2.x)";
  return false;
}
void set_onednn_use(OnednnUse) {}
OnednnUse onednn_use() { return OnednnUse::kNever; }
OnednnMatmulStats onednn_matmul_stats() { return {}; }

}  // namespace mpt::cpu
