#pragma once
// A model with the data it trains on and the loss and accuracy that go
// with it: the pieces mpt-train varies with --model and --data.
#include <memory>

#include "models/char_dataset.h"
#include "models/dataset.h"
#include "models/module.h"
#include "tensor/random.h"
#include "tools/mpt-train/train_config.h"

namespace mpt::train {

struct Workload {
  std::shared_ptr<nn::Module> model;
  std::shared_ptr<const data::Dataset> train_set, eval_set;
  std::string description;  // one line for the start of the log
  std::string data_identity;  // what the data is (data::content_fingerprint of its files), however it was named

  // Mean cross-entropy of a batch (f32), and how many of its predictions
  // (images or next characters) are right.
  Tensor loss(const Tensor& output, const Tensor& target) const;
  int64_t correct(const Tensor& output, const Tensor& target) const;
  int64_t predictions(const data::Batch& batch) const;
  Tensor forward(const Tensor& input) const;
  bool sequences = false;      // gpt: outputs [B, T, V]
  bool flatten_input = false;  // mlp: [N, 1, 28, 28] -> [N, 784]
  int64_t eval_stride = 1;     // evaluate every eval_stride-th sample
  std::shared_ptr<const data::CharDataset> text;  // gpt: the training text (its vocabulary), for samples
};

// Builds the model (weights drawn from `gen`) and loads the data sets.
Workload make_workload(const TrainConfig& config, Generator& gen);

}  // namespace mpt::train
