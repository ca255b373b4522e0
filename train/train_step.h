#pragma once
// One optimizer step: forward, loss and backward for each of its
// micro-batches (their gradients averaged: the step is the mean over all of
// them, as one big batch would give), then gradient clipping and the
// precision's optimizer step (the loss scaler's skip on overflow
// included). Under DDP only the last micro-batch all-reduces (no_sync for
// the others), and the scaler's overflow decision is agreed by all ranks.
// Under DataParallel each micro-batch is split over the replicas.
//
// On a GPU (not under DataParallel, which drives several) the step may be
// recorded once as a CUDA graph and replayed, one launch a step: it then
// reads nothing back to the host, and the learning rate reaches it through
// the optimizer's device copy. New batch shapes (an epoch's short last
// batch) capture again; a step that cannot be captured runs eagerly from
// then on, and fallback_reason() says why.
//
// The step laps the active StepTimer (tensor/step_timer.h) at its phases
// and stamps the active GpuTimeline; it counts its loss (and, for a
// classifier, its right predictions) into `totals` on the device.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "models/dataset.h"
#include "models/module.h"
#include "models/optimizer.h"
#include "parallel/data_parallel.h"
#include "parallel/distributed_data_parallel.h"
#include "tensor/graph.h"
#include "tensor/step_timer.h"
#include "train/mixed_precision.h"
#include "train/objective.h"
#include "train/training_totals.h"

namespace mpt::train {

// Where a step's work runs: one device, DDP (the model wrapped, on this
// process's device) or DataParallel (replicas on several devices of this
// process; the model is replica 0).
struct Placement {
  Device device = kCPU;
  dist::DistributedDataParallel* ddp = nullptr;
  dist::DataParallel* dp = nullptr;
};

class TrainStep {
 public:
  // `graph`: record the step as a CUDA graph (a GPU, no DataParallel, and a
  // capturable optimizer; the caller checks). `model` is the module trained
  // (under DDP and DataParallel, the wrapped one). `totals`: where the
  // step counts its loss and predictions; null counts nothing (the last
  // micro-batch's loss is kept, last_loss()).
  TrainStep(nn::Module& model, const Objective& objective, optim::Optimizer& optimizer, MixedPrecision& precision,
            TrainingTotals* totals, Placement placement, double max_grad_norm, bool graph);
  ~TrainStep();

  // One step over `batches` (its micro-batches, on any device). A graphed
  // step also copies `next` (the next step's, when known) into its inputs
  // once its backward pass is done, beside its optimizer, so that the next
  // step starts at once.
  void run(const std::vector<data::Batch>& batches, const std::vector<data::Batch>& next = {});

  // Called after each phase of an eager step on a device (forward,
  // backward, optimizer), for diagnostics such as memory traces.
  void on_phase(std::function<void(StepPhase)> hook) { on_phase_ = std::move(hook); }

  // For a batch that lives on the device and stays the same from step to
  // step (a benchmark's): the graph reads it in place instead of copying it
  // into its own inputs (CapturedStep::read_inputs_in_place).
  void read_inputs_in_place() {
    if (captured_) captured_->read_inputs_in_place(true);
  }

  // Drops a captured graph (after the optimizer's or the model's tensors
  // were replaced, by a checkpoint's restore say): the next steps capture
  // again.
  void reset_graph() {
    if (captured_) captured_->reset();
  }

  // The last micro-batch's loss of the latest step (a replayed graph
  // rewrites the same tensor); waits for the device.
  double last_loss() const { return last_loss_.defined() ? last_loss_.item() : 0.0; }

  bool graph() const { return captured_ != nullptr; }
  int64_t replays() const { return captured_ ? captured_->replays() : 0; }
  int64_t captures() const { return captured_ ? captured_->captures() : 0; }
  // Empty unless capturing failed (the steps run eagerly from then on).
  std::string fallback_reason() const { return captured_ ? captured_->fallback_reason() : std::string(); }

 private:
  // The step on {input, target} per micro-batch, on the device.
  void step(const std::vector<Tensor>& inputs);
  // DataParallel's step: each micro-batch split over the replicas.
  void data_parallel_step(const std::vector<data::Batch>& batches);
  void clip_and_step();
  void phase_done(StepPhase phase);

  nn::Module& model_;
  const Objective& objective_;
  optim::Optimizer& optimizer_;
  MixedPrecision& precision_;
  TrainingTotals* totals_;
  Tensor last_loss_;
  Placement placement_;
  double max_grad_norm_;
  std::unique_ptr<CapturedStep> captured_;
  std::function<void(StepPhase)> on_phase_;
};

}  // namespace mpt::train
