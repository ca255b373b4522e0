#pragma once
// 2-d convolution on CUDA through cuDNN, for the CUDA backend. Operands are
// contiguous NCHW views of one dtype on the current device; outputs are
// overwritten. Half types accumulate in f32; f32 uses TF32 only when
// allow_tf32() is on.
#include "tensor/backend.h"

namespace mpt::cuda {

// Whether each new convolution geometry times cuDNN's algorithms once and
// keeps the fastest deterministic one (PyTorch's cudnn.benchmark), or takes
// cuDNN's heuristic pick (the default: the timed picks were no faster for
// the reference CNN, and timing them needs a workspace). Process-wide.
void set_conv_autotune(bool on);
bool conv_autotune();

void conv2d_forward(const TensorView& out, const TensorView& x, const TensorView& w, const Conv2dParams& p);
void conv2d_backward_data(const TensorView& grad_x, const TensorView& grad_out, const TensorView& w,
                          const Conv2dParams& p);
void conv2d_backward_weight(const TensorView& grad_w, const TensorView& x, const TensorView& grad_out,
                            const Conv2dParams& p);

}  // namespace mpt::cuda
