#pragma once
// Learning-rate schedules as pure functions of the step number, so a
// resumed run needs only the step count to continue the same curve.
#include <cstdint>

namespace mpt::optim {

class Optimizer;

class LrSchedule {
 public:
  // The same lr at every step.
  static LrSchedule constant(double lr);
  // Linear warm-up then cosine decay (the GPT recipe):
  //   step <  warmup:          lr * (step + 1) / warmup
  //   warmup <= step < total:  min_lr + (lr - min_lr) * (1 + cos(pi * (step - warmup) / (total - warmup))) / 2
  //   step >= total:           min_lr
  // Warm-up counts from step + 1 so that step 0 already moves the weights
  // and the last warm-up step reaches lr exactly.
  static LrSchedule cosine(double lr, int64_t warmup_steps, int64_t total_steps, double min_lr = 0.0);
  // The same warm-up, then a straight line down (the fine-tuning recipe):
  //   warmup <= step < total:  min_lr + (lr - min_lr) * (total - step) / (total - warmup)
  //   step >= total:           min_lr
  static LrSchedule linear(double lr, int64_t warmup_steps, int64_t total_steps, double min_lr = 0.0);

  // Steps count from 0; a negative step is a ValueError.
  double lr_at(int64_t step) const;
  // Sets the first parameter group's lr to lr_at(step), and every other
  // group's to lr_at(step) times the ratio of the two groups' initial lrs,
  // so groups made with their own lrs keep their proportions, as under
  // PyTorch's schedulers (an embedding at a tenth of the rest stays there).
  // A first group made with lr 0 gives every group lr_at(step).
  void apply(Optimizer& optimizer, int64_t step) const;

  double base_lr() const { return lr_; }
  double min_lr() const { return min_lr_; }
  int64_t warmup_steps() const { return warmup_; }
  int64_t total_steps() const { return total_; }

 private:
  enum class Kind { constant, cosine, linear };
  LrSchedule(Kind kind, double lr, int64_t warmup, int64_t total, double min_lr)
      : kind_(kind), lr_(lr), warmup_(warmup), total_(total), min_lr_(min_lr) {}

  Kind kind_;
  double lr_;
  int64_t warmup_, total_;
  double min_lr_;
};

}  // namespace mpt::optim
