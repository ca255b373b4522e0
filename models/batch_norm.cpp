#include "models/batch_norm.h"

#include <algorithm>
#include <cmath>

#include "autograd/grad_mode.h"
#include "autograd/ops.h"

namespace mpt::nn {

BatchNorm::BatchNorm(std::string type_name, int64_t num_features, const BatchNormOptions& options,
                     std::vector<int64_t> ranks, std::string layout)
    : Module(std::move(type_name)), num_features(num_features), options(options), ranks_(std::move(ranks)),
      layout_(std::move(layout)) {
  check(num_features > 0, "{}: num_features must be positive, got {}", this->type_name(), num_features);
  check(std::isfinite(options.eps) && options.eps >= 0, "{}: eps must be finite and >= 0, got {}", this->type_name(),
        options.eps);
  check(!options.momentum || (*options.momentum >= 0 && *options.momentum <= 1),
        "{}: momentum must be in [0, 1], got {}", this->type_name(), options.momentum.value_or(0));
  if (options.affine) {
    weight = register_parameter("weight", ones({num_features}));
    bias = register_parameter("bias", zeros({num_features}));
  }
  if (options.track_running_stats) {
    running_mean = register_buffer("running_mean", zeros({num_features}));
    running_var = register_buffer("running_var", ones({num_features}));
    num_batches_tracked = register_buffer("num_batches_tracked", zeros({}, DType::i64));
  }
}

Tensor BatchNorm::forward(const Tensor& x) {
  if (!(x.defined() && std::find(ranks_.begin(), ranks_.end(), x.dim()) != ranks_.end() &&
        x.size(1) == num_features))  // (the message made only for a failure: this runs at every forward)
    throw ShapeError(fmt::format("{}({}): input {} must be {}", type_name(), num_features, describe(x), layout_));
  const bool update = is_training() && running_mean.defined();
  double momentum = options.momentum.value_or(0.0);
  if (update) {
    NoGradGuard no_grad;
    // An i64 count, stepped through f64 (exact to 2^53): element-wise ops
    // take floating tensors only.
    prim::copy_(num_batches_tracked, prim::add_scalar(prim::to(num_batches_tracked, DType::f64), 1.0));
    if (!options.momentum) momentum = 1.0 / static_cast<double>(num_batches_tracked.item());
  }
  // Batch statistics in training, and in eval mode without running ones.
  return batch_norm(x, running_mean, running_var, weight, bias, /*training=*/update || !running_mean.defined(),
                    momentum, options.eps);
}

BatchNorm1d::BatchNorm1d(int64_t num_features, const BatchNormOptions& options)
    : BatchNorm("BatchNorm1d", num_features, options, {2, 3}, fmt::format("[N, {}] or [N, {}, L]", num_features,
                                                                        num_features)) {}

BatchNorm2d::BatchNorm2d(int64_t num_features, const BatchNormOptions& options)
    : BatchNorm("BatchNorm2d", num_features, options, {4}, fmt::format("[N, {}, H, W]", num_features)) {}

}  // namespace mpt::nn
