#include "amp/scaler_sweep.h"

#include "tensor/error.h"

namespace mpt::amp {

std::vector<SweepRun> sweep_growth_interval(const GradScalerOptions& base, const std::vector<int64_t>& intervals,
                                            const TrainingRun& train, const SweepProgress& progress) {
  check(!intervals.empty(), "sweep_growth_interval: no growth intervals given");
  check(static_cast<bool>(train), "sweep_growth_interval: no training function given");
  std::vector<SweepRun> runs;
  for (int64_t interval : intervals) {
    GradScalerOptions options = base;
    options.growth_interval = interval;
    scale_rule_from(options);  // checks the interval
    SweepRun run;
    run.growth_interval = interval;
    run.final_loss = train(options, [&run](const ScalerTraceRow& row) {
      ++run.steps;
      run.skipped_steps += row.skipped ? 1 : 0;
      ++run.steps_at_scale[row.scale];
      run.trace.push_back(row);
    });
    runs.push_back(std::move(run));
    if (progress) progress(runs.size(), intervals.size());
  }
  return runs;
}

}  // namespace mpt::amp
