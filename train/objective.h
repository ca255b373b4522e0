#pragma once
// What a model is trained to do with a batch: how the batch's input is
// given to it, the loss of its output against the batch's target, and
// whether it classifies (then a step also counts its right predictions).
#include <functional>

#include "tensor/tensor.h"

namespace mpt::train {

struct Objective {
  // The batch's mean loss, a one-element f32 tensor.
  std::function<Tensor(const Tensor& output, const Tensor& target)> loss;
  // The model's input made from the batch's (empty: the input as it is).
  // Applied before the model, on the whole batch (DataParallel splits what
  // it returns), so it is meant for reshapes and casts.
  std::function<Tensor(const Tensor& input)> prepare;
  // The output holds class scores in its last dimension and the target
  // class indices: the steps count right predictions (accuracy).
  bool classification = false;

  // Right predictions of `output` for `target` (read to the host).
  int64_t correct(const Tensor& output, const Tensor& target) const;
  // What one batch's target counts as predictions (its elements).
  static int64_t predictions(const Tensor& target) { return target.numel(); }
  Tensor model_input(const Tensor& input) const { return prepare ? prepare(input) : input; }
};

// Cross-entropy of class scores in the output's last dimension ([N, C], or
// [B, T, V] for sequences) against class indices, with accuracy: the
// reference models' objective. `flatten_input`: the input's dimensions
// after the first are flattened into one (images into an MLP's vectors).
Objective classification(bool flatten_input = false);

}  // namespace mpt::train
