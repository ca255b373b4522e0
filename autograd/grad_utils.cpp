#include "autograd/grad_utils.h"

#include "tensor/operand_check.h"

namespace mpt {

Tensor sum_to(const Tensor& g, const Shape& shape) {
  if (g.shape() == shape) return g;
  const int64_t lead = g.dim() - static_cast<int64_t>(shape.size());
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < g.dim(); ++d)
    if (d < lead || (shape[d - lead] == 1 && g.shape()[d] != 1)) dims.push_back(d);
  return prim::reshape(prim::sum(g, dims, true), shape);
}

Tensor grad_for(const Tensor& g, const TensorMeta& input) {
  return prim::to(sum_to(g, input.shape), input.dtype);
}

Tensor as_rows(const Tensor& x) {
  const int64_t d = x.shape().back();
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < x.shape().size(); ++i) rows *= x.shape()[i];
  return prim::reshape(x, {rows, d});
}

void check_linear_operands(const char* op, const Tensor& x, const Tensor& weight, const Tensor& bias) {
  check_defined(op, x);
  check_defined(op, weight);
  check<ShapeError>(weight.dim() == 2 && x.dim() >= 1 && x.shape().back() == weight.shape()[1],
                    "{}: input {} does not match weight {} (expected [..., {}])", op, describe(x), describe(weight),
                    weight.dim() == 2 ? weight.shape()[1] : -1);
  check<ShapeError>(!bias.defined() || (bias.dim() == 1 && bias.shape()[0] == weight.shape()[0]),
                    "{}: bias {} does not match weight {}", op, describe(bias), describe(weight));
}

}  // namespace mpt
