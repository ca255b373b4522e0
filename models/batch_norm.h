#pragma once
// Batch normalisation layers with PyTorch's parameters, buffers and names
// (weight, bias; running_mean, running_var, num_batches_tracked), so their
// state dicts load on either side. In training mode a forward normalises by
// the batch's statistics and updates the running ones; in eval mode it
// normalises by the running ones. DistributedDataParallel broadcasts rank
// 0's buffers before each synchronised forward, as PyTorch's does.
#include <optional>
#include <string>
#include <vector>

#include "models/module.h"

namespace mpt::nn {

struct BatchNormOptions {
  double eps = 1e-5;
  // Each new batch's weight in the running statistics; none: their
  // cumulative average over every batch so far (which reads the batch count
  // on the host at each training forward, so a CUDA graph cannot hold it).
  std::optional<double> momentum = 0.1;
  bool affine = true;               // a learned weight (ones) and bias (zeros)
  bool track_running_stats = true;  // without: batch statistics in eval mode too
};

class BatchNorm : public Module {
 public:
  Tensor forward(const Tensor& x) override;

  int64_t num_features;
  BatchNormOptions options;
  Tensor weight, bias;                                    // undefined without affine
  Tensor running_mean, running_var, num_batches_tracked;  // undefined without track_running_stats

 protected:
  // `ranks`: the input ranks the layer takes, `layout` names them for messages.
  BatchNorm(std::string type_name, int64_t num_features, const BatchNormOptions& options, std::vector<int64_t> ranks,
            std::string layout);

 private:
  std::vector<int64_t> ranks_;
  std::string layout_;
};

// Over the channels of [N, C] or [N, C, L].
class BatchNorm1d : public BatchNorm {
 public:
  explicit BatchNorm1d(int64_t num_features, const BatchNormOptions& options = {});
};

// Over the channels of [N, C, H, W].
class BatchNorm2d : public BatchNorm {
 public:
  explicit BatchNorm2d(int64_t num_features, const BatchNormOptions& options = {});
};

}  // namespace mpt::nn
