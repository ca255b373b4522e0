#pragma once
// The GPU side of fill_slots (parallel/bucket.h); a CPU-only build has a
// stub that says so.
#include <vector>

#include "tensor/tensor.h"

namespace mpt::dist::cuda {

// slots[i] = grads[i] * scale: contiguous tensors on one GPU, the gradients
// of one floating dtype and the slots of one (the same or not), on that
// device's current stream.
void scaled_copy_list(const std::vector<Tensor>& slots, const std::vector<Tensor>& grads, double scale);

}  // namespace mpt::dist::cuda
