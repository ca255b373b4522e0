#pragma once
// Helpers for writing ops and their backward rules (in autograd/ and in
// the layers above that add ops of their own, such as amp's fp8_linear).
#include "tensor/ops.h"

namespace mpt {

// What a backward rule may need of an input besides its values. Rules that
// need only this keep it instead of the tensor, so the input's memory is
// freed as soon as the forward pass is done with it.
struct TensorMeta {
  Shape shape;
  DType dtype;
  Device device;
  bool requires_grad;
};
inline TensorMeta meta_of(const Tensor& t) { return {t.shape(), t.dtype(), t.device(), t.requires_grad()}; }

// Sums a broadcast gradient back down to `shape`.
Tensor sum_to(const Tensor& g, const Shape& shape);
// The gradient for `input` from a gradient of the (broadcast, promoted)
// result: summed to input's shape and cast to input's dtype.
Tensor grad_for(const Tensor& g, const TensorMeta& input);

// x [..., d] as [rows, d], its leading dimensions folded into rows. Not
// reshape(x, {-1, d}): where a size is 0 that -1 could be anything.
Tensor as_rows(const Tensor& x);

// The operand checks of a linear layer's op (`op` names it in errors):
// x [..., in], weight [out, in], bias [out] or undefined.
void check_linear_operands(const char* op, const Tensor& x, const Tensor& weight, const Tensor& bias);

}  // namespace mpt
