#include "models/cnn.h"

#include <utility>

#include "models/batch_norm.h"
#include "models/layers.h"

namespace mpt::nn {

std::shared_ptr<Sequential> make_cnn(const CNNOptions& o, Generator* gen) {
  check(o.in_channels > 0 && o.channels1 > 0 && o.channels2 > 0 && o.hidden > 0 && o.num_classes > 0,
        "make_cnn: channels ({}, {}, {}), hidden {} and num_classes {} must be positive", o.in_channels, o.channels1,
        o.channels2, o.hidden, o.num_classes);
  check(o.image_size > 0 && o.image_size % 4 == 0,
        "make_cnn: image_size {} must be a positive multiple of 4 (two 2x2 poolings)", o.image_size);
  const int64_t pooled = o.image_size / 4;
  auto net = std::make_shared<Sequential>();
  for (const auto& [in, out] : {std::pair{o.in_channels, o.channels1}, std::pair{o.channels1, o.channels2}}) {
    net->push_back(std::make_shared<Conv2d>(in, out, 3, 1, 1, /*bias=*/!o.batch_norm, gen));
    if (o.batch_norm) net->push_back(std::make_shared<BatchNorm2d>(out));
    net->push_back(std::make_shared<ReLU>());
    net->push_back(std::make_shared<MaxPool2d>(2));
  }
  net->push_back(std::make_shared<Flatten>());
  net->push_back(std::make_shared<Linear>(o.channels2 * pooled * pooled, o.hidden, true, gen));
  net->push_back(std::make_shared<ReLU>());
  net->push_back(std::make_shared<Linear>(o.hidden, o.num_classes, true, gen));
  return net;
}

}  // namespace mpt::nn
