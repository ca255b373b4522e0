#pragma once
// The training run behind mpt-train: its options become a reference
// workload and a train::Trainer (the library's step and loop), with what a
// command line adds around them: the run recorded in its checkpoints and
// resumed from them, the ranks' settings compared, evaluation and text
// samples after every epoch, progress lines, metrics, a GPU sampler and a
// clean stop on SIGINT or SIGTERM.
#include <cstdint>

#include "tools/mpt-train/train_config.h"

namespace mpt::tools {

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

}  // namespace mpt::tools
