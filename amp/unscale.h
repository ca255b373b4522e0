#pragma once
// The scaler's one pass over the gradients: multiply each gradient by
// inv_scale in place and raise found_inf when any element of any gradient is
// inf or NaN (PyTorch's _amp_foreach_non_finite_check_and_unscale_).
#include <vector>

#include "tensor/tensor.h"

namespace mpt::amp {

// grads: contiguous f32, f16 or bf16 tensors, all on one device (the
// products are computed in f32 and rounded back). found_inf: f32 [1] on that
// device; set to 1 when a non-finite value is seen, never reset here (so
// several calls accumulate). inv_scale: f32 [1] on that device. On the CPU
// this runs on the calling thread; on CUDA it is one multi-tensor kernel
// launch (more for very long lists) on the current stream, without a host
// sync.
void unscale_and_check_inf_(std::vector<Tensor>& grads, Tensor& found_inf, const Tensor& inv_scale);
// The check alone: found_inf raised when any element of `grads` is inf or
// NaN, the gradients left as they are (half the memory traffic).
void check_inf_(const std::vector<Tensor>& grads, Tensor& found_inf);

}  // namespace mpt::amp
