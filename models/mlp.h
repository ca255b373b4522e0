#pragma once
// The reference MLP (workload mlp_small): Linear, ReLU, ..., Linear, as a
// Sequential so parameter names are PyTorch's nn.Sequential names
// ("0.weight", "2.bias", ...) and a checkpoint loads by name in PyTorch.
#include <memory>
#include <vector>

#include "models/sequential.h"
#include "tensor/random.h"

namespace mpt::nn {

struct MLPOptions {
  int64_t in_features = 784;
  std::vector<int64_t> hidden = {1024, 1024};
  int64_t num_classes = 10;
};

// Input [N, in_features], output logits [N, num_classes]. The default
// options give exactly the reference's 784-1024-1024-10.
std::shared_ptr<Sequential> make_mlp(const MLPOptions& options = {}, Generator* gen = nullptr);

}  // namespace mpt::nn
