#include "train/train_step.h"

#include <atomic>
#include <optional>

#include "autograd/ops.h"
#include "models/clip_grad.h"
#include "tensor/gpu_timeline.h"
#include "tensor/nvtx.h"

namespace mpt::train {
namespace {

void lap(StepPhase phase) {
  if (StepTimer* timer = StepTimer::active()) timer->lap(phase);
}

// {input, target} of each micro-batch, in order: a step's inputs.
std::vector<Tensor> step_inputs(const std::vector<data::Batch>& batches) {
  std::vector<Tensor> inputs;
  for (const data::Batch& b : batches) {
    inputs.push_back(b.input);
    inputs.push_back(b.target);
  }
  return inputs;
}

}  // namespace

TrainStep::TrainStep(nn::Module& model, const Objective& objective, optim::Optimizer& optimizer,
                     MixedPrecision& precision, TrainingTotals* totals, Placement placement, double max_grad_norm,
                     bool graph)
    : model_(model),
      objective_(objective),
      optimizer_(optimizer),
      precision_(precision),
      totals_(totals),
      placement_(placement),
      max_grad_norm_(max_grad_norm) {
  check(objective_.loss != nullptr, "TrainStep: the objective has no loss function");
  check(!(placement_.dp && placement_.ddp), "TrainStep: DataParallel and DDP at once");
  check(!graph || (placement_.device.is_cuda() && !placement_.dp),
        "TrainStep: only a step on one GPU (DDP's included) is captured as a CUDA graph, not one on {}{}",
        placement_.device.str(), placement_.dp ? " under DataParallel" : "");
  if (graph)
    captured_ = std::make_unique<CapturedStep>(placement_.device,
                                               [this](const std::vector<Tensor>& inputs) { step(inputs); });
}

TrainStep::~TrainStep() = default;

void TrainStep::run(const std::vector<data::Batch>& batches, const std::vector<data::Batch>& next) {
  check(!batches.empty(), "TrainStep::run: a step needs at least one micro-batch");
  if (totals_)
    for (const data::Batch& b : batches) totals_->count(Objective::predictions(b.target));
  if (placement_.dp) {
    lap(StepPhase::data_wait);
    data_parallel_step(batches);
    return;
  }
  std::vector<Tensor> inputs = step_inputs(batches);
  if (!captured_) {
    for (Tensor& t : inputs) t = prim::to(t, placement_.device);
    lap(StepPhase::data_wait);
    step(inputs);
    return;
  }
  lap(StepPhase::data_wait);
  {
    // Timing events cannot be recorded into a graph: the replay (with the
    // copy of the batch into the graph's inputs) is timed as one phase.
    StepTimer::Activation untimed(nullptr);
    captured_->run(inputs, step_inputs(next));
  }
  lap(StepPhase::graph);
}

void TrainStep::phase_done(StepPhase phase) {
  lap(phase);
  if (on_phase_) on_phase_(phase);
}

void TrainStep::step(const std::vector<Tensor>& inputs) {
  const Device& device = placement_.device;
  const auto group = static_cast<int64_t>(inputs.size() / 2);
  const double weight = 1.0 / static_cast<double>(group);
  gpu_stamp(device, "step start");
  optimizer_.zero_grad();
  if (totals_) totals_->start_step();
  for (int64_t micro = 0; micro < group; ++micro) {
    const Tensor& input = inputs[2 * micro];
    const Tensor& target = inputs[2 * micro + 1];
    // Under DDP, only the last micro-batch of a step all-reduces.
    std::optional<dist::DistributedDataParallel::NoSyncGuard> local_only;
    if (placement_.ddp && micro + 1 < group) local_only.emplace(*placement_.ddp);
    Tensor out, loss;
    {
      NvtxRange range("forward");
      out = precision_.forward([&] {
        const Tensor x = objective_.model_input(input);
        return placement_.ddp ? placement_.ddp->forward(x) : model_.forward(x);
      });
      loss = objective_.loss(out, target);
    }
    gpu_stamp(device, "forward done");
    phase_done(StepPhase::forward);
    {
      // Micro-batch gradients add up; weighting each by 1/group makes the
      // step the mean over the whole group.
      NvtxRange range("backward");
      precision_.backward(group > 1 ? loss * weight : loss, input.dim() > 0 ? input.size(0) : 1);
    }
    phase_done(StepPhase::backward);
    if (totals_) {
      totals_->add(loss, Objective::predictions(target), weight);
      if (objective_.classification) totals_->add_correct(out, target);
    }
    last_loss_ = loss;
    lap(StepPhase::other);
  }
  // The optimizer reads no inputs: the next step's batches may be copied in.
  CapturedStep::inputs_consumed();
  gpu_stamp(device, "backward done");
  clip_and_step();
  gpu_stamp(device, "step end");
  phase_done(StepPhase::optimizer);
}

void TrainStep::clip_and_step() {
  NvtxRange range("optimizer");
  if (max_grad_norm_ > 0) {
    precision_.unscale();
    nn::clip_grad_norm_on_device_(optimizer_.scalable_parameters(), max_grad_norm_);
  }
  precision_.step();
}

void TrainStep::data_parallel_step(const std::vector<data::Batch>& batches) {
  optimizer_.zero_grad();
  if (totals_) totals_->start_step();
  const auto group = static_cast<int64_t>(batches.size());
  const double weight = 1.0 / static_cast<double>(group);
  for (const data::Batch& b : batches) {
    // Each replica counts its right predictions on the host: the replicas
    // return the loss there anyway.
    std::atomic<int64_t> right{0};
    auto loss_fn = [&](const Tensor& out, const Tensor& y) {
      if (objective_.classification) right += objective_.correct(out, y);
      const Tensor l = objective_.loss(out, y);
      return group > 1 ? l * weight : l;
    };
    const Tensor x = objective_.model_input(b.input);
    const double value = precision_.forward([&] {
      return placement_.dp->forward_backward(x, b.target, loss_fn, precision_.scaler());
    }) / weight;
    if (totals_) totals_->add(value, right, Objective::predictions(b.target), weight);
    last_loss_ = scalar_tensor(value, DType::f32);
  }
  lap(StepPhase::other);
  clip_and_step();
  lap(StepPhase::optimizer);
}

}  // namespace mpt::train
