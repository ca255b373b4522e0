// The parts of tensor/cuda_info.h shared by every build: the version
// formatting and the compute-capability rule.
#include "tensor/cuda_info.h"

#include <fmt/format.h>

namespace mpt::cuda {

std::string unsupported_compute_capability(int major, int minor) {
  if (major >= kMinComputeMajor) return "";
  return fmt::format("compute capability {}.{}; mptrain's GPU kernels need {}.0 or newer (Ampere, Hopper and later)",
                     major, minor, kMinComputeMajor);
}

std::string cuda_version_text(int v) { return v > 0 ? fmt::format("{}.{}", v / 1000, v % 1000 / 10) : "none"; }

std::string cudnn_version_text(int v) {
  return v > 0 ? fmt::format("{}.{}.{}", v / 10000, v / 100 % 100, v % 100) : "none";
}

}  // namespace mpt::cuda
