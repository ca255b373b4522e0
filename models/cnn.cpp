#include "models/cnn.h"

#include "models/layers.h"

namespace mpt::nn {

std::shared_ptr<Sequential> make_cnn(const CNNOptions& o, Generator* gen) {
  check(o.in_channels > 0 && o.channels1 > 0 && o.channels2 > 0 && o.hidden > 0 && o.num_classes > 0,
        "make_cnn: channels ({}, {}, {}), hidden {} and num_classes {} must be positive", o.in_channels, o.channels1,
        o.channels2, o.hidden, o.num_classes);
  check(o.image_size > 0 && o.image_size % 4 == 0,
        "make_cnn: image_size {} must be a positive multiple of 4 (two 2x2 poolings)", o.image_size);
  const int64_t pooled = o.image_size / 4;
  return std::make_shared<Sequential>(std::initializer_list<std::shared_ptr<Module>>{
      std::make_shared<Conv2d>(o.in_channels, o.channels1, 3, 1, 1, true, gen),
      std::make_shared<ReLU>(),
      std::make_shared<MaxPool2d>(2),
      std::make_shared<Conv2d>(o.channels1, o.channels2, 3, 1, 1, true, gen),
      std::make_shared<ReLU>(),
      std::make_shared<MaxPool2d>(2),
      std::make_shared<Flatten>(),
      std::make_shared<Linear>(o.channels2 * pooled * pooled, o.hidden, true, gen),
      std::make_shared<ReLU>(),
      std::make_shared<Linear>(o.hidden, o.num_classes, true, gen),
  });
}

}  // namespace mpt::nn
