#pragma once
// Helpers for writing backward rules.
#include "tensor/ops.h"

namespace mpt {

// Sums a broadcast gradient back down to `shape`.
Tensor sum_to(const Tensor& g, const Shape& shape);
// The gradient for `input` from a gradient of the (broadcast, promoted)
// result: summed to input's shape and cast to input's dtype.
Tensor grad_for(const Tensor& g, const Tensor& input);

}  // namespace mpt
