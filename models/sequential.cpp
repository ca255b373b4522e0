#include "models/sequential.h"

#include <typeinfo>

#include "models/layers.h"

namespace mpt::nn {

Sequential::Sequential(std::initializer_list<std::shared_ptr<Module>> modules) : Module("Sequential") {
  for (const auto& m : modules) push_back(m);
}

Tensor Sequential::forward(const Tensor& x) {
  Tensor y = x;
  for (size_t i = 0; i < layers_.size(); ++i) {
    Module& layer = *layers_[i];
    // Exact types: a subclass may compute something else.
    if (typeid(layer) == typeid(Linear) && i + 1 < layers_.size() && typeid(*layers_[i + 1]) == typeid(ReLU)) {
      y = static_cast<Linear&>(layer).forward_relu(y);
      ++i;
      continue;
    }
    y = layer.forward(y);
  }
  return y;
}

}  // namespace mpt::nn
