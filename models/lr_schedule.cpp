#include "models/lr_schedule.h"

#include <cmath>
#include <numbers>

#include "models/optimizer.h"
#include "tensor/error.h"

namespace mpt::optim {

LrSchedule LrSchedule::constant(double lr) {
  check(std::isfinite(lr) && lr >= 0, "LrSchedule::constant: invalid learning rate {} (must be >= 0)", lr);
  return LrSchedule(Kind::constant, lr, 0, 0, lr);
}

namespace {

// A warm-up then a decay from lr to min_lr over the steps after it.
void check_decay(const char* name, double lr, int64_t warmup_steps, int64_t total_steps, double min_lr) {
  check(std::isfinite(lr) && lr >= 0, "LrSchedule::{}: invalid learning rate {} (must be >= 0)", name, lr);
  check(std::isfinite(min_lr) && min_lr >= 0 && min_lr <= lr, "LrSchedule::{}: min_lr {} must be in [0, lr = {}]",
        name, min_lr, lr);
  // At least one step after the warm-up: with none, every step would be at
  // min_lr or warming up, a schedule that never reaches its decay.
  check(warmup_steps >= 0 && total_steps > warmup_steps,
        "LrSchedule::{}: need 0 <= warmup_steps < total_steps, got warmup_steps {} total_steps {}", name,
        warmup_steps, total_steps);
}

}  // namespace

LrSchedule LrSchedule::cosine(double lr, int64_t warmup_steps, int64_t total_steps, double min_lr) {
  check_decay("cosine", lr, warmup_steps, total_steps, min_lr);
  return LrSchedule(Kind::cosine, lr, warmup_steps, total_steps, min_lr);
}

LrSchedule LrSchedule::linear(double lr, int64_t warmup_steps, int64_t total_steps, double min_lr) {
  check_decay("linear", lr, warmup_steps, total_steps, min_lr);
  return LrSchedule(Kind::linear, lr, warmup_steps, total_steps, min_lr);
}

double LrSchedule::lr_at(int64_t step) const {
  check(step >= 0, "LrSchedule::lr_at: step must be >= 0, got {}", step);
  if (kind_ == Kind::constant) return lr_;
  if (step < warmup_) return lr_ * static_cast<double>(step + 1) / static_cast<double>(warmup_);
  if (step >= total_) return min_lr_;
  const double progress = static_cast<double>(step - warmup_) / static_cast<double>(total_ - warmup_);
  if (kind_ == Kind::linear) return min_lr_ + (lr_ - min_lr_) * (1.0 - progress);
  return min_lr_ + (lr_ - min_lr_) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
}

void LrSchedule::apply(Optimizer& optimizer, int64_t step) const {
  const double lr = lr_at(step), first = optimizer.initial_lr(0);
  for (size_t g = 0; g < optimizer.num_groups(); ++g)
    optimizer.set_lr(g, first > 0 ? lr * (optimizer.initial_lr(g) / first) : lr);
}

}  // namespace mpt::optim
