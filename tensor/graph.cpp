#include "tensor/graph.h"

#include "tensor/cuda/graph.h"
#include "tensor/device_guard.h"
#include "tensor/ops.h"
#include "tensor/pinned.h"
#include "tensor/stream_per_device.h"

namespace mpt {
namespace {

// The CapturedStep whose step function runs on this thread, for
// inputs_consumed().
thread_local CapturedStep* t_running = nullptr;

class Running {
 public:
  explicit Running(CapturedStep* step) : previous_(t_running) { t_running = step; }
  ~Running() { t_running = previous_; }
  Running(const Running&) = delete;
  Running& operator=(const Running&) = delete;

 private:
  CapturedStep* previous_;
};

// One stream per device for the batches copied in ahead of their steps,
// shared by the device's CapturedSteps.
Stream input_copy_stream(const Device& device) {
  static auto* streams = new StreamPerDevice();  // leaked: used until exit
  return streams->get(device);
}

bool same_tensor(const Tensor& a, const Tensor& b) {
  return a.data_ptr() == b.data_ptr() && a.device() == b.device() && a.dtype() == b.dtype() &&
         a.shape() == b.shape() && a.strides() == b.strides();
}

}  // namespace

CapturedStep::CapturedStep(const Device& device, StepFn step, int eager_steps)
    : device_(device), step_(std::move(step)), eager_steps_(eager_steps) {
  check(step_ != nullptr, "CapturedStep: no step function");
  check(eager_steps_ >= 1, "CapturedStep: eager_steps must be at least 1 (the first step creates state), got {}",
        eager_steps_);
  if (device_.is_cuda()) {
    check_device_available(device_);
    batch_ready_ = std::make_unique<Event>(device_);
    consumed_ = std::make_unique<Event>(device_);
    staged_ready_ = std::make_unique<Event>(device_);
  }
  if (device_.is_cpu()) fallback_reason_ = "CPU steps are not captured";
}

CapturedStep::~CapturedStep() {
  // The inputs go back to the allocator with this object: a copy into them
  // must not outlive it.
  if (!staged_.empty()) {
    try {
      staged_ready_->synchronize();
    } catch (...) {
      // A destructor cannot throw; the error was the copy's, or an earlier kernel's.
    }
  }
}

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

void CapturedStep::load_inputs(const std::vector<Tensor>& batch) {
  if (!same_layout(batch)) {
    // New shapes: fresh fixed inputs, and the graph of the old ones is useless.
    reset();
    inputs_.clear();
    for (const Tensor& t : batch)
      inputs_.push_back(in_place_ && t.device() == device_ && t.is_contiguous() ? t : prim::clone(prim::to(t, device_)));
    return;
  }
  for (size_t i = 0; i < batch.size(); ++i)
    if (batch[i].data_ptr() != inputs_[i].data_ptr()) prim::copy_(inputs_[i], batch[i]);
}

// Whether the inputs hold `batch` already (copied by the previous run).
// Either way a pending copy is over, on `stream`, before anything reads or
// replaces the inputs.
bool CapturedStep::take_staged(const std::vector<Tensor>& batch, const Stream& stream) {
  if (staged_.empty()) return false;
  const std::vector<Tensor> staged = std::move(staged_);
  staged_.clear();
  bool same = staged.size() == batch.size();
  for (size_t i = 0; same && i < batch.size(); ++i) same = same_tensor(staged[i], batch[i]);
  // Inputs of other shapes are freed in load_inputs: only the host can be
  // sure the copy into them has ended before their memory is handed out.
  if (!same && !same_layout(batch)) staged_ready_->synchronize();
  else staged_ready_->wait(stream);
  return same;
}

void CapturedStep::step_once() {
  consumed_marked_ = false;
  if (graph_) {
    graph_->replay();
    ++replays_;
    consumed_marked_ = graph_marks_consumed_;
    return;
  }
  Running running(this);
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
    consumed_marked_ = false;  // the record went with the abandoned capture
    step_(inputs_);            // the capture enqueued nothing: this step still has to happen
    return;
  }
  graph_marks_consumed_ = consumed_marked_;
  graph_ = std::move(graph);
  ++captures_;
  graph_->replay();  // capturing recorded the step without running it
  ++replays_;
}

void CapturedStep::stage(const std::vector<Tensor>& next, const Stream& stream) {
  if (!consumed_marked_) consumed_->record(stream);
  const Stream copies = input_copy_stream(device_);
  batch_ready_->wait(copies);
  consumed_->wait(copies);
  std::vector<Tensor> sources;
  for (const Tensor& t : next)
    // A copy from pageable memory would hold the host until the step got
    // there; from pinned memory it returns at once.
    sources.push_back(t.device().is_cpu() && !is_pinned(t) ? pin_memory(t) : t);
  {
    StreamGuard on_copies(copies);
    for (size_t i = 0; i < next.size(); ++i)
      if (sources[i].data_ptr() != inputs_[i].data_ptr()) prim::copy_(inputs_[i], sources[i]);
  }
  staged_ready_->record(copies);
  staged_ = next;
}

void CapturedStep::run(const std::vector<Tensor>& batch) { run(batch, {}); }

void CapturedStep::run(const std::vector<Tensor>& batch, const std::vector<Tensor>& next) {
  DeviceGuard on_device(device_);
  const Stream stream = current_stream(device_);
  if (!take_staged(batch, stream)) load_inputs(batch);
  const bool ahead = device_.is_cuda() && !next.empty() && same_layout(next);
  // `next` is ready where the caller's stream is now, before this step.
  if (ahead) batch_ready_->record(stream);
  step_once();
  if (ahead) stage(next, stream);
}

void CapturedStep::inputs_consumed() {
  CapturedStep* self = t_running;
  if (self == nullptr || !self->consumed_) return;
  self->consumed_->record_external(current_stream(self->device_));
  self->consumed_marked_ = true;
}

}  // namespace mpt
