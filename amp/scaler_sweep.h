#pragma once
// Sweeping a real training run across growth intervals: the same training,
// once per interval, with statistics drawn from the scaler's trace.
#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "amp/grad_scaler.h"

namespace mpt::amp {

struct SweepRun {
  int64_t growth_interval = 0;
  int64_t steps = 0;                      // scaler updates
  int64_t skipped_steps = 0;              // updates whose step was skipped
  std::map<double, int64_t> steps_at_scale;  // scale -> updates made at it
  double final_loss = 0;                  // what the training returned
  std::vector<ScalerTraceRow> trace;
};

// Runs one whole training: build a fresh model and optimizer, train with a
// loss scaler of `options` whose trace goes to `trace` (each update's row),
// and return the final loss.
using TrainingRun = std::function<double(const GradScalerOptions& options, const ScalerTraceSink& trace)>;
// Called after each run with (runs done, runs in all).
using SweepProgress = std::function<void(size_t done, size_t total)>;

std::vector<SweepRun> sweep_growth_interval(const GradScalerOptions& base, const std::vector<int64_t>& intervals,
                                            const TrainingRun& train, const SweepProgress& progress = {});

}  // namespace mpt::amp
