#include "autograd/grad_utils.h"

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

}  // namespace mpt
