#pragma once
// The NCCL backend (CUDA tensors). Implemented in parallel/cuda/ for CUDA
// builds; parallel/cuda_stubs.cpp says so in CPU-only builds.
#include <memory>

#include "parallel/process_group.h"

namespace mpt::dist {

std::shared_ptr<ProcessGroup> new_nccl_process_group(const std::shared_ptr<Store>& store, int rank, int size,
                                                     int device, const ProcessGroupOptions& options);

}  // namespace mpt::dist
