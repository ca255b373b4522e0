#include "models/mlp.h"

#include "models/layers.h"

namespace mpt::nn {

std::shared_ptr<Sequential> make_mlp(const MLPOptions& options, Generator* gen) {
  check(options.in_features > 0 && options.num_classes > 0,
        "make_mlp: in_features {} and num_classes {} must be positive", options.in_features, options.num_classes);
  auto net = std::make_shared<Sequential>();
  int64_t width = options.in_features;
  for (int64_t h : options.hidden) {
    check(h > 0, "make_mlp: hidden width {} must be positive", h);
    net->push_back(std::make_shared<Linear>(width, h, true, gen));
    net->push_back(std::make_shared<ReLU>());
    width = h;
  }
  net->push_back(std::make_shared<Linear>(width, options.num_classes, true, gen));
  return net;
}

}  // namespace mpt::nn
