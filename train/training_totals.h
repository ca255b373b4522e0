#pragma once
// What an epoch's training steps add up to: the loss summed over the
// predictions, the right predictions, and the latest step's loss. The sums
// live on the training device and grow by device ops, so counting makes the
// step wait for nothing (one that did would need the GPU to finish each
// micro-batch, and could not be captured as a CUDA graph); the host reads
// them only to show them: at a progress line, at the epoch's end. The
// evaluation after each epoch counts with one too.
#include <cstdint>

#include "tensor/tensor.h"

namespace mpt::train {

class TrainingTotals {
 public:
  explicit TrainingTotals(const Device& device);

  // Zeroes every sum (on the device's current stream).
  void start_epoch();

  // Inside a step, so that a captured step does them at each replay:
  // start_step() before its first micro-batch, then add() for each, with
  // its mean loss, the predictions it holds and its share of the step's
  // loss, and for a classifier add_correct() with its outputs (classes in
  // the last dimension) and targets (class indices).
  void start_step();
  void add(const Tensor& loss, int64_t predictions, double weight);
  void add_correct(const Tensor& output, const Tensor& target);
  // Outside the step: the predictions a micro-batch holds (known from its
  // shape, so counted on the host; a replayed step runs no host code).
  void count(int64_t predictions) { predictions_ += predictions; }
  // A micro-batch from values the host has already (DataParallel's
  // replicas count on their own devices), its predictions counted with it.
  void add(double loss, int64_t correct, int64_t predictions, double weight);

  // The epoch's sums so far, carried in a checkpoint across a stop so that
  // the resumed run sums up the whole epoch. sums() waits for the device.
  struct Sums {
    double loss = 0;  // per-prediction losses added up
    double correct = 0;
    int64_t predictions = 0;
  };
  Sums sums() const;
  // Starts an epoch that goes on from `sums` (what sums() gave before the stop).
  void resume_epoch(const Sums& sums);

  // These wait for the device's work so far.
  double step_loss() const;
  double mean_loss() const;  // per prediction, over the epoch so far (0 before any)
  double accuracy() const;   // right predictions over predictions (0 before any)
  int64_t predictions() const { return predictions_; }

 private:
  // f64 [1] on the device: an epoch of per-prediction losses stays exact
  // to far below what is shown.
  Tensor loss_sum_, correct_, step_loss_;
  // Added on the host (add(double, ...)).
  double host_loss_sum_ = 0, host_correct_ = 0, host_step_loss_ = 0;
  int64_t predictions_ = 0;
};

}  // namespace mpt::train
