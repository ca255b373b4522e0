#pragma once
// The Gloo backend (CPU tensors, TCP transport). Built when CMake finds
// Gloo (MPT_WITH_GLOO); otherwise new_gloo_process_group() throws
// NotAvailableError.
#include <memory>

#include "parallel/process_group.h"

namespace mpt::dist {

std::shared_ptr<ProcessGroup> new_gloo_process_group(const std::shared_ptr<Store>& store, int rank, int size,
                                                     const ProcessGroupOptions& options);

}  // namespace mpt::dist
