#pragma once
// CapturedStep: a training step recorded once as a CUDA graph and replayed,
// so a step of a small model costs one launch instead of hundreds of kernel
// launches from the host.
//
// The step function must enqueue the same work every time its inputs have
// the same shapes, and must not wait for the GPU inside (no item(), no
// to_vector(), no host-side decisions on device values): the loss scaler
// and the fused optimizers decide on the device, and index checks report at
// the next synchronization. Inputs are fixed tensors the step reads: run()
// copies each new batch into them before the replay. Tensors the step
// creates (the loss, the gradients) live in the graph's own memory and are
// overwritten by every replay.
//
// Fallbacks, so a step that cannot be captured still trains:
//  - the first `eager_steps` runs for a set of input shapes are eager (they
//    create optimizer state and pick cuBLAS/cuDNN algorithms);
//  - new input shapes drop the graph and start over with them;
//  - a step that fails to capture (it synchronizes, or uses something a
//    graph cannot hold) runs eagerly from then on; fallback_reason() says
//    why. The failed attempt enqueued nothing, but host-side state the step
//    changed before the failure (counters, say) stays changed.
//  - on the CPU every step is eager.
// A step with collectives inside (DDP's all-reduces) is watched at every
// replay as they are when eager: a dead peer ends it within the group's
// timeout, and run() first waits for the previous replay (the collectives
// register a cuda::ReplayWatch while the step is captured).
// The next batch can be copied in while a step runs (run(batch, next)): on
// a stream of its own, from the point where the step no longer reads its
// inputs (inputs_consumed(), or the step's end) while the rest of the step
// (communication, the optimizer) goes on; the next run waits for the copy,
// not for the host.
// Values the step passes to kernels as numbers are frozen into the graph:
// call reset() after changing them. A capturable optimizer's learning rate
// is not one of them (it is read on the device): set_lr() between runs, as
// a schedule does, needs no reset.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tensor/stream.h"
#include "tensor/tensor.h"

namespace mpt {

namespace cuda {
class Graph;
}

class CapturedStep {
 public:
  // step(inputs): one training step reading `inputs` (the fixed copies).
  using StepFn = std::function<void(const std::vector<Tensor>& inputs)>;

  CapturedStep(const Device& device, StepFn step, int eager_steps = 3);
  ~CapturedStep();
  CapturedStep(const CapturedStep&) = delete;
  CapturedStep& operator=(const CapturedStep&) = delete;

  // One step on `batch` (any devices; copied into the fixed inputs).
  void run(const std::vector<Tensor>& batch = {});
  // One step on `batch`, then `next` copied into the fixed inputs beside
  // the rest of this step, so that a following run(next) copies nothing.
  // `next` must keep its values until that run; a run on other tensors
  // copies them as usual. On the CPU nothing is copied ahead.
  void run(const std::vector<Tensor>& batch, const std::vector<Tensor>& next);

  // For step functions: the step reads its inputs no more from this point
  // of the current stream (where its backward pass ended, say), so the next
  // batch may be copied in from here. Does nothing outside a CapturedStep.
  static void inputs_consumed();
  // Drops the graph: the next runs are eager, then it is captured again.
  void reset();
  // For batches that live on the step's device and stay as they are from
  // step to step (a benchmark's fixed batch): a contiguous batch tensor on
  // the device becomes the fixed input itself when the inputs take their
  // shapes, so the graph reads it in place and passing it again copies
  // nothing. A different batch of those shapes is then copied into it.
  void read_inputs_in_place(bool on) { in_place_ = on; }

  bool captured() const { return graph_ != nullptr; }
  int64_t replays() const { return replays_; }
  int64_t captures() const { return captures_; }
  // Empty unless capturing failed (then every step runs eagerly).
  const std::string& fallback_reason() const { return fallback_reason_; }

 private:
  bool same_layout(const std::vector<Tensor>& batch) const;
  void load_inputs(const std::vector<Tensor>& batch);
  bool take_staged(const std::vector<Tensor>& batch, const Stream& stream);
  void step_once();
  void stage(const std::vector<Tensor>& next, const Stream& stream);

  Device device_;
  StepFn step_;
  int eager_steps_;
  std::vector<Tensor> inputs_;
  bool in_place_ = false;  // read_inputs_in_place
  int eager_runs_ = 0;  // since the inputs took their shapes
  std::unique_ptr<cuda::Graph> graph_;
  int64_t replays_ = 0;
  int64_t captures_ = 0;
  std::string fallback_reason_;

  // The copy of the next batch (run(batch, next)).
  std::vector<Tensor> staged_;          // whose values are in the inputs, or on their way
  std::unique_ptr<Event> batch_ready_;  // the caller's stream before the step: `next` is there
  std::unique_ptr<Event> consumed_;     // the step reads the inputs no more
  std::unique_ptr<Event> staged_ready_;  // the copy is done
  bool consumed_marked_ = false;        // this run's step called inputs_consumed()
  bool graph_marks_consumed_ = false;   // the captured graph records consumed_ itself
};

}  // namespace mpt
