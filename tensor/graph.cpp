#include "tensor/graph.h"

#include "tensor/cuda/graph.h"
#include "tensor/device_guard.h"
#include "tensor/ops.h"

namespace mpt {

CapturedStep::CapturedStep(const Device& device, StepFn step, int eager_steps)
    : device_(device), step_(std::move(step)), eager_steps_(eager_steps) {
  check(step_ != nullptr, "CapturedStep: no step function");
  check(eager_steps_ >= 1, "CapturedStep: eager_steps must be at least 1 (the first step creates state), got {}",
        eager_steps_);
  if (device_.is_cuda()) check_device_available(device_);
  if (device_.is_cpu()) fallback_reason_ = "CPU steps are not captured";
}

CapturedStep::~CapturedStep() = default;

bool CapturedStep::same_layout(const std::vector<Tensor>& batch) const {
  if (batch.size() != inputs_.size()) return false;
  for (size_t i = 0; i < batch.size(); ++i)
    if (batch[i].shape() != inputs_[i].shape() || batch[i].dtype() != inputs_[i].dtype()) return false;
  return true;
}

void CapturedStep::reset() {
  graph_.reset();
  eager_runs_ = 0;
}

void CapturedStep::run(const std::vector<Tensor>& batch) {
  DeviceGuard on_device(device_);
  if (!same_layout(batch)) {
    // New shapes: fresh fixed inputs, and the graph of the old ones is useless.
    reset();
    inputs_.clear();
    for (const Tensor& t : batch) inputs_.push_back(prim::clone(prim::to(t, device_)));
  } else {
    for (size_t i = 0; i < batch.size(); ++i)
      if (batch[i].data_ptr() != inputs_[i].data_ptr()) prim::copy_(inputs_[i], batch[i]);
  }

  if (graph_) {
    graph_->replay();
    ++replays_;
    return;
  }
  if (!fallback_reason_.empty() || eager_runs_ < eager_steps_) {
    step_(inputs_);
    ++eager_runs_;
    return;
  }
  auto graph = std::make_unique<cuda::Graph>(device_.index);
  try {
    graph->capture([&] { step_(inputs_); });
  } catch (const Error& e) {
    fallback_reason_ = e.what();
    step_(inputs_);  // the capture enqueued nothing: this step still has to happen
    return;
  }
  graph_ = std::move(graph);
  ++captures_;
  graph_->replay();  // capturing recorded the step without running it
  ++replays_;
}

}  // namespace mpt
