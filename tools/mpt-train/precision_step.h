#pragma once
#include "autograd/ops.h"
#include "models/optimizer.h"
#include "tools/mpt-train/train_config.h"

namespace mpt::train {

// The one place where mixed precision plugs in. In fp32 a step is plain
// backward() and optimizer.step(). With fp16/bf16, forward() runs under the
// amp layer's autocast guard, backward() scales the loss first, and step()
// becomes the GradScaler's unscale / inf-check / step / update; its state
// goes into the checkpoint's extra tensors.
class PrecisionStep {
 public:
  PrecisionStep(const TrainConfig& c, optim::Optimizer& optimizer) : optimizer_(optimizer) {
    check(c.precision == "fp32" || c.precision == "fp16" || c.precision == "bf16",
          "mpt-train: unknown --precision '{}' (fp16, bf16, fp32)", c.precision);
    check<NotAvailableError>(c.precision == "fp32",
                             "mpt-train: --precision {} needs the amp layer (autocast and GradScaler), which this "
                             "build does not have yet; use --precision fp32",
                             c.precision);
  }
  template <typename F>
  Tensor forward(F&& f) {
    return f();
  }
  void backward(const Tensor& loss) { mpt::backward(loss); }
  // Whether the step was taken (a loss scaler skips steps with inf/NaN gradients).
  bool step() {
    optimizer_.step();
    return true;
  }
  double scale() const { return 1.0; }
  OrderedDict<Tensor> state_dict() const { return {}; }
  void load_state_dict(const OrderedDict<Tensor>& state) {
    check(state.empty(), "mpt-train: the checkpoint holds loss-scaler state ({} tensors) but this run is fp32",
          state.size());
  }

 private:
  optim::Optimizer& optimizer_;
};

}  // namespace mpt::train
