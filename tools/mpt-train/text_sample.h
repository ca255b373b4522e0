#pragma once
// What a GPT run shows of its model as it learns: a piece of text sampled
// from it after each epoch (and after a finished run resumed), printed and
// recorded in the metrics.
#include <vector>

#include "models/generate.h"
#include "tools/mpt-train/progress.h"
#include "tools/mpt-train/train_config.h"
#include "train/workload.h"

namespace mpt::tools {

class TextSampler {
 public:
  // Off (enabled() false) unless the workload is a GPT on text and
  // --sample-tokens is above 0. The prompt is checked here, before any
  // training (ValueError naming --sample-prompt and the byte).
  TextSampler(const train::Workload& w, const TrainConfig& c);
  bool enabled() const { return model_ != nullptr; }

  // The model after `step` optimizer steps goes on from the prompt. The
  // draws come from a stream of their own, decided by --seed and the step:
  // a resumed run samples what an unbroken one would, and the training's
  // own draws do not move.
  void sample(int64_t step, Progress& progress) const;

 private:
  nn::GPT* model_ = nullptr;
  std::shared_ptr<const data::CharDataset> text_;
  std::vector<int64_t> prompt_;
  int64_t tokens_ = 0;
  nn::SamplingOptions options_;
  uint64_t seed_ = 0;
};

}  // namespace mpt::tools
