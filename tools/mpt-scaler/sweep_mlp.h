#pragma once
// The training the sweep runs until the reference models land: an MLP
// (nn layers) classifying synthetic data labelled by a fixed random teacher,
// with autocast and the given scaler. Same seed, same data and init in every
// run, so runs differ only in the scaler.
#include <cstdint>
#include <functional>

#include "amp/grad_scaler.h"
#include "tensor/device.h"
#include "tensor/dtype.h"

namespace mpt::tools {

struct SyntheticMlpConfig {
  int64_t steps = 500;
  int64_t batch = 64;
  int64_t in_features = 32;
  int64_t hidden = 128;
  int64_t classes = 10;
  double lr = 1e-3;
  Device device = kCPU;
  DType autocast_dtype = DType::f16;
  uint64_t seed = 0;
};

// Trains and returns the mean loss over the last 10% of steps (f32).
// on_step (if set) is called after each step with the steps done.
double train_synthetic_mlp(const SyntheticMlpConfig& config, amp::GradScaler& scaler,
                           const std::function<void(int64_t)>& on_step = {});

}  // namespace mpt::tools
