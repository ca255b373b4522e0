// CPU-only builds: the NCCL backend and the GPU kernels are not there, and say so.
#include "parallel/local_communicator.h"
#include "parallel/nccl_info.h"
#include "parallel/nccl_process_group.h"

namespace mpt::dist {

std::shared_ptr<ProcessGroup> new_nccl_process_group(const std::shared_ptr<Store>&, int rank, int size, int device,
                                                     const ProcessGroupOptions&) {
  throw NotAvailableError(fmt::format(
      "new_nccl_process_group (rank {} of {}, cuda:{}): this build of mptrain has no CUDA, so no NCCL backend; "
      "use CPU tensors (Gloo) or rebuild with the CUDA toolkit",
      rank, size, device));
}

}  // namespace mpt::dist

namespace mpt::dist {

std::unique_ptr<LocalCommunicator> new_nccl_local_communicator(const std::vector<Device>& devices) {
  throw NotAvailableError(fmt::format(
      "DataParallel over {} CUDA devices: this build of mptrain has no CUDA, so no NCCL; use virtual CPU devices "
      "(cpu:0, cpu:1, ...) or rebuild with the CUDA toolkit",
      devices.size()));
}

}  // namespace mpt::dist

namespace mpt::dist {

NcclVersions nccl_versions() { return {}; }

}  // namespace mpt::dist

