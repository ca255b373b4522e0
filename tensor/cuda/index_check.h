#pragma once
// The GPU half of tensor/index_check.h (no CUDA headers: portable code calls it).
#include <cstdint>
#include <optional>

#include "tensor/cuda/index_check_kernel.h"
#include "tensor/tensor.h"

namespace mpt::cuda {

// Enqueues the check kernel for `indices` (on a CUDA device) on the current stream.
void enqueue_index_check(const char* op, const Tensor& indices, int64_t bound, std::optional<int64_t> ignore);
// Raises the ValueError a check kernel recorded on `device`, if any (and
// clears it). Called right after each synchronization with the device.
void raise_index_check_failure(int device);

}  // namespace mpt::cuda
