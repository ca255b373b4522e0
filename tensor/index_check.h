#pragma once
// Index checks that do not stop the host. On the CPU an out-of-range index
// throws at once. On a GPU, reading the indices back would synchronize every
// embedding and cross-entropy call (and forbid CUDA graphs), so a kernel
// checks them instead and records the first bad one in host-mapped memory;
// the error is raised by the next synchronization with that device (item(),
// to_vector(), Stream/Event/device synchronize), naming the op, the index
// and the range. Until then the ops that read the indices treat a bad one
// safely (zero rows, NaN losses) and never touch memory outside the table.
#include <cstdint>
#include <optional>

#include "tensor/tensor.h"

namespace mpt {

// Every index of `indices` (i64 or i32, any shape) must lie in [0, bound),
// except those equal to `ignore`. `op` names the caller in the message.
void check_index_range(const char* op, const Tensor& indices, int64_t bound, std::optional<int64_t> ignore = std::nullopt);

}  // namespace mpt
