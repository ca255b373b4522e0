#pragma once
// One optimizer step of mpt-train: forward, loss and backward for each of
// its micro-batches (only the last one all-reduces under DDP), the counts of
// TrainingTotals, then the precision step. Eager, or (--cuda-graph)
// recorded once as a CUDA graph and replayed, one launch a step: the step
// then reads nothing back to the host, and the learning rate reaches it
// through the optimizer's device copy. New batch shapes (an epoch's short
// last batch, a short last accumulation group) capture again; a step that
// cannot be captured runs eagerly, and fallback_reason() says why.
// DataParallel's step is the trainer's own: it drives several GPUs at once.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "models/dataset.h"
#include "models/optimizer.h"
#include "parallel/distributed_data_parallel.h"
#include "tensor/graph.h"
#include "tools/mpt-train/precision_step.h"
#include "tools/mpt-train/training_totals.h"
#include "tools/mpt-train/workload.h"

namespace mpt::train {

class TrainingStep {
 public:
  // ddp: null unless the run is DDP. graph: capture (`device` must be a GPU
  // and the optimizer capturable; the caller checks).
  TrainingStep(const Workload& workload, PrecisionStep& precision, optim::Optimizer& optimizer,
               TrainingTotals& totals, dist::DistributedDataParallel* ddp, const Device& device, bool graph);
  ~TrainingStep();

  // One step over `batches` (its micro-batches, as the loader gives them).
  // A graphed step also copies `next` (the next step's, if known) into its
  // inputs once its backward pass is done, beside its optimizer, so that
  // the next step starts at once. Laps the active StepTimer: data_wait,
  // then forward, backward, optimizer (eager) or graph (the whole step,
  // replayed).
  void run(const std::vector<data::Batch>& batches, const std::vector<data::Batch>& next = {});

  bool graph() const { return captured_ != nullptr; }
  int64_t replays() const { return captured_ ? captured_->replays() : 0; }
  int64_t captures() const { return captured_ ? captured_->captures() : 0; }
  // Empty unless capturing failed (the steps run eagerly from then on).
  std::string fallback_reason() const { return captured_ ? captured_->fallback_reason() : std::string(); }

 private:
  // The step itself, on {input, target} per micro-batch on the device.
  void step(const std::vector<Tensor>& inputs);

  const Workload& workload_;
  PrecisionStep& precision_;
  optim::Optimizer& optimizer_;
  TrainingTotals& totals_;
  dist::DistributedDataParallel* ddp_;
  Device device_;
  std::unique_ptr<CapturedStep> captured_;
};

}  // namespace mpt::train
