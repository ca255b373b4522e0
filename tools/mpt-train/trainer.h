#pragma once
// The training run behind mpt-train: builds the workload, then loops over
// epochs of optimizer steps (each of `accumulation` micro-batches, as a CUDA
// graph where it can be) with the learning-rate schedule, evaluation after
// every epoch, progress and metrics, and checkpoints that a later run
// resumes bit-identically.
#include <cstdint>

#include "tools/mpt-train/train_config.h"

namespace mpt::train {

struct TrainResult {
  int64_t steps = 0;
  double eval_loss = 0, eval_accuracy = 0;
  double seconds = 0;
  bool interrupted = false;    // stopped by SIGINT/SIGTERM after a whole step
  bool stopped_early = false;  // interrupted, or ended by --stop-after before the run's last step
};

// Refuses values that no run could take (ValueError naming the flag): the
// checks that need no device, data or peers. run_training runs them first.
void check_options(const TrainConfig& config);

// Throws mpt::Error for anything the configuration or the data get wrong.
TrainResult run_training(const TrainConfig& config);

}  // namespace mpt::train
