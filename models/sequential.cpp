#include "models/sequential.h"

namespace mpt::nn {

Sequential::Sequential(std::initializer_list<std::shared_ptr<Module>> modules) : Module("Sequential") {
  for (const auto& m : modules) push_back(m);
}

Tensor Sequential::forward(const Tensor& x) {
  Tensor y = x;
  for (const auto& layer : layers_) y = layer->forward(y);
  return y;
}

}  // namespace mpt::nn
