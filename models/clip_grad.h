#pragma once
// Gradient clipping by global norm, PyTorch's clip_grad_norm_ semantics.
#include <limits>
#include <vector>

#include "tensor/tensor.h"

namespace mpt::nn {

inline constexpr double kInfNorm = std::numeric_limits<double>::infinity();

// Treats the gradients of `params` (those without one are skipped) as one
// long vector, returns its norm of order norm_type (any p > 0, or kInfNorm),
// and scales every gradient in place by min(1, max_norm / (total + 1e-6)).
// A non-finite total is returned as is and, as in PyTorch, poisons the
// gradients (NaN), which a loss scaler then detects. Norms accumulate in f32
// (f64 when a gradient is f64), on the first gradient's device; reading the
// total back is the one host sync (the price of returning a double).
double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type = 2.0);

// The same clipping without reading anything back: the total norm and the
// coefficient stay on the device and every gradient is multiplied by it,
// so a step recorded as a CUDA graph clips at each replay. Returns the
// total norm as a 0-d tensor on the first gradient's device (undefined
// when no parameter has a gradient).
Tensor clip_grad_norm_on_device_(const std::vector<Tensor>& params, double max_norm, double norm_type = 2.0);

}  // namespace mpt::nn
