#include "tools/mpt-train/training_step.h"

#include <optional>

#include "autograd/ops.h"
#include "tensor/nvtx.h"
#include "tensor/step_timer.h"

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

TrainingStep::TrainingStep(const Workload& workload, PrecisionStep& precision, optim::Optimizer& optimizer,
                           TrainingTotals& totals, dist::DistributedDataParallel* ddp, const Device& device,
                           bool graph)
    : workload_(workload),
      precision_(precision),
      optimizer_(optimizer),
      totals_(totals),
      ddp_(ddp),
      device_(device) {
  if (graph)
    captured_ = std::make_unique<CapturedStep>(device, [this](const std::vector<Tensor>& inputs) { step(inputs); });
}

TrainingStep::~TrainingStep() = default;

void TrainingStep::run(const std::vector<data::Batch>& batches, const std::vector<data::Batch>& next) {
  for (const data::Batch& b : batches) totals_.count(workload_.predictions(b));
  std::vector<Tensor> inputs = step_inputs(batches);
  if (!captured_) {
    for (Tensor& t : inputs) t = prim::to(t, device_);
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

void TrainingStep::step(const std::vector<Tensor>& inputs) {
  const auto group = static_cast<int64_t>(inputs.size() / 2);
  const double weight = 1.0 / static_cast<double>(group);
  optimizer_.zero_grad();
  totals_.start_step();
  for (int64_t micro = 0; micro < group; ++micro) {
    const Tensor& input = inputs[2 * micro];
    const Tensor& target = inputs[2 * micro + 1];
    // Under DDP, only the last micro-batch of a step all-reduces.
    std::optional<dist::DistributedDataParallel::NoSyncGuard> local_only;
    if (ddp_ && micro + 1 < group) local_only.emplace(*ddp_);
    if (ddp_) ddp_->before_forward();
    Tensor out, loss;
    {
      NvtxRange range("forward");
      out = precision_.forward([&] { return workload_.forward(input); });
      loss = workload_.loss(out, target);
    }
    lap(StepPhase::forward);
    {
      // Micro-batch gradients add up; averaging them makes the step the
      // mean over the whole group, as one big batch would give.
      NvtxRange range("backward");
      precision_.backward(group > 1 ? loss * weight : loss);
    }
    lap(StepPhase::backward);
    totals_.add(loss, out, target, weight);
    lap(StepPhase::other);
  }
  // The optimizer reads no inputs: the next step's batches may be copied in.
  CapturedStep::inputs_consumed();
  {
    NvtxRange range("optimizer");
    precision_.step();
  }
  lap(StepPhase::optimizer);
}

}  // namespace mpt::train
