#pragma once
// The reference workloads: a model with the data it trains on and its
// objective. The MLP and the CNN on Fashion-MNIST, and a GPT on a text
// file (characters as tokens, its last tenth held out), as mpt-train,
// mpt-scaler's sweep and the examples train them.
#include <memory>
#include <string>
#include <vector>

#include "models/char_dataset.h"
#include "models/dataset.h"
#include "models/module.h"
#include "tensor/random.h"
#include "train/objective.h"

namespace mpt::train {

struct WorkloadOptions {
  std::string model = "mlp";  // mlp, cnn, gpt
  // mlp, cnn: "fashion-mnist" (Debian's copy) or a folder holding
  // Fashion-MNIST's four .gz files; gpt: a text file, or "fortunes" (its
  // default corpus). Empty: the model's own.
  std::string data;
  int64_t context = 256;  // gpt: sequence length (and rows of the position table)
  int64_t gpt_layers = 6, gpt_heads = 6, gpt_d_model = 384;
  std::vector<int64_t> mlp_hidden = {1024, 1024};  // mlp: the hidden layers' widths
};

struct Workload {
  std::shared_ptr<nn::Module> model;
  std::shared_ptr<const data::Dataset> train_set, eval_set;
  Objective objective;        // cross-entropy and accuracy (the MLP's input flattened)
  std::string description;    // one line for the start of a log
  std::string data_identity;  // what the data is (data::content_fingerprint of its files), however it was named
  bool sequences = false;     // gpt: outputs [B, T, V], targets [B, T]
  int64_t eval_stride = 1;    // evaluate every eval_stride-th sample (text windows overlap)
  std::shared_ptr<const data::CharDataset> text;  // gpt: the training text (its vocabulary), for samples
};

// The data a workload trains on: options.data, or the model's own.
std::string workload_data(const WorkloadOptions& options);

// Builds the model (weights drawn from `gen`) and loads the data sets.
// ValueError naming what does not fit (data for the other kind of model, a
// text too short for the context); IOError for data that cannot be read.
Workload make_workload(const WorkloadOptions& options, Generator& gen);

}  // namespace mpt::train
