#pragma once
// Which dtype each op runs in under autocast. The lists follow PyTorch's CUDA
// autocast op lists (aten/src/ATen/autocast_mode.h and .cpp,
// "lower_precision_fp", "fp32" and "promote"), restricted to the ops this
// library has; cat promotes, as on PyTorch's CPU. One table serves both
// devices: PyTorch's CPU list leaves exp, log, pow, softmax, log_softmax,
// layer_norm and sum in bf16, where this one runs them in f32. cross_entropy
// takes 16-bit logits as they are: it computes in f32 from any dtype, so
// PyTorch's f32 copy of them would change nothing but the memory used.
#include <string_view>

#include "tensor/dtype.h"

namespace mpt::amp {

enum class CastPolicy {
  lower_precision,  // matmul-like ops: run in the autocast dtype (f16 or bf16)
  fp32,             // ops that lose range or accuracy in 16 bits: run in f32
  promote,          // ops of several inputs: cast all to the widest floating input
  none,             // run in whatever dtypes the inputs have
};

// The policy of an autograd op by its name ("linear", "softmax", ...);
// `none` for ops autocast leaves alone (relu, reshape, ...).
CastPolicy autocast_policy(std::string_view op);

}  // namespace mpt::amp
