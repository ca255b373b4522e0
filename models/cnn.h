#pragma once
// The reference CNN (workload cnn), as a Sequential so parameter names are
// PyTorch's: Conv3x3 in->c1 pad 1, ReLU, MaxPool2; Conv3x3 c1->c2 pad 1,
// ReLU, MaxPool2; Flatten; Linear c2*(S/4)^2 -> hidden, ReLU, Linear
// hidden -> classes. Defaults: 1x28x28 images, 32, 64, 256, 10. With
// batch_norm, each convolution (then without a bias, as is usual before a
// norm) is followed by a BatchNorm2d: Conv, BatchNorm2d, ReLU, MaxPool2.
#include <memory>

#include "models/sequential.h"
#include "tensor/random.h"

namespace mpt::nn {

struct CNNOptions {
  int64_t in_channels = 1;
  int64_t image_size = 28;  // square images; must be divisible by 4
  int64_t channels1 = 32;
  int64_t channels2 = 64;
  int64_t hidden = 256;
  int64_t num_classes = 10;
  bool batch_norm = false;
};

// Input [N, in_channels, image_size, image_size], output [N, num_classes].
std::shared_ptr<Sequential> make_cnn(const CNNOptions& options = {}, Generator* gen = nullptr);

}  // namespace mpt::nn
