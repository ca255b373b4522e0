#include "train/training_totals.h"

#include "tensor/ops.h"

namespace mpt::train {
namespace {

// sum += x, in place on the device (both 0-d f64).
void accumulate(const Tensor& sum, const Tensor& x) { prim::binary_(BinaryOp::add, sum, sum, x); }

}  // namespace

TrainingTotals::TrainingTotals(const Device& device)
    : loss_sum_(zeros({}, DType::f64, device)),
      correct_(zeros({}, DType::f64, device)),
      step_loss_(zeros({}, DType::f64, device)) {}

void TrainingTotals::start_epoch() {
  prim::fill_(loss_sum_, 0.0);
  prim::fill_(correct_, 0.0);
  prim::fill_(step_loss_, 0.0);
  host_loss_sum_ = host_correct_ = host_step_loss_ = 0;
  predictions_ = 0;
}

void TrainingTotals::start_step() {
  prim::fill_(step_loss_, 0.0);
  host_step_loss_ = 0;
}

void TrainingTotals::add(const Tensor& loss, int64_t predictions, double weight) {
  check<ShapeError>(loss.numel() == 1, "TrainingTotals::add: needs a one-element loss, got {}", describe(loss));
  const Tensor l = prim::to(prim::reshape(loss, {}), DType::f64);
  accumulate(loss_sum_, prim::mul_scalar(l, static_cast<double>(predictions)));
  accumulate(step_loss_, prim::mul_scalar(l, weight));
}

void TrainingTotals::add_correct(const Tensor& output, const Tensor& target) {
  check<ShapeError>(output.dim() == target.dim() + 1,
                    "TrainingTotals::add_correct: needs outputs with one more dimension than the targets, got output "
                    "{}, target {}",
                    describe(output), describe(target));
  // Class indices are exact in f64, where the device's comparisons work.
  const Tensor predicted = prim::to(prim::argmax(output, output.dim() - 1), DType::f64);
  const Tensor right = prim::binary(BinaryOp::eq, predicted, prim::to(target, DType::f64));
  accumulate(correct_, prim::sum(right));
}

void TrainingTotals::add(double loss, int64_t correct, int64_t predictions, double weight) {
  host_loss_sum_ += loss * static_cast<double>(predictions);
  host_correct_ += static_cast<double>(correct);
  host_step_loss_ += loss * weight;
  predictions_ += predictions;
}

TrainingTotals::Sums TrainingTotals::sums() const {
  return {loss_sum_.item() + host_loss_sum_, correct_.item() + host_correct_, predictions_};
}

void TrainingTotals::resume_epoch(const Sums& sums) {
  start_epoch();
  host_loss_sum_ = sums.loss;
  host_correct_ = sums.correct;
  predictions_ = sums.predictions;
}

double TrainingTotals::step_loss() const { return step_loss_.item() + host_step_loss_; }

double TrainingTotals::mean_loss() const {
  return predictions_ > 0 ? (loss_sum_.item() + host_loss_sum_) / static_cast<double>(predictions_) : 0.0;
}

double TrainingTotals::accuracy() const {
  return predictions_ > 0 ? (correct_.item() + host_correct_) / static_cast<double>(predictions_) : 0.0;
}

}  // namespace mpt::train
