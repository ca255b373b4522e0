#include "train/objective.h"

#include "autograd/ops.h"

namespace mpt::train {

int64_t Objective::correct(const Tensor& output, const Tensor& target) const {
  const std::vector<int64_t> predicted = prim::argmax(output, output.dim() - 1).to_vector<int64_t>();
  const std::vector<int64_t> truth = target.to_vector<int64_t>();
  int64_t n = 0;
  for (size_t i = 0; i < truth.size(); ++i) n += predicted[i] == truth[i];
  return n;
}

Objective classification(bool flatten_input) {
  Objective o;
  o.loss = [](const Tensor& output, const Tensor& target) {
    if (output.dim() <= 2) return cross_entropy(output, target);
    const int64_t classes = output.size(output.dim() - 1);
    return cross_entropy(reshape(output, {-1, classes}), reshape(target, {-1}));
  };
  if (flatten_input) o.prepare = [](const Tensor& input) { return flatten(input, 1); };
  o.classification = true;
  return o;
}

}  // namespace mpt::train
