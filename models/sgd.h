#pragma once
// Stochastic gradient descent with PyTorch's exact rule (torch.optim.SGD):
//   d = g + weight_decay * p
//   if momentum != 0:
//     buf = d                                           (first update)
//     buf = momentum * buf + (1 - dampening) * d        (later updates)
//     d = nesterov ? d + momentum * buf : buf
//   p = p - lr * d
// State: "momentum_buffer" (only with momentum).
// Capturable (Optimizer::set_capturable): the first update is the one whose
// device-side count is 0, so a first step the loss scaler skipped on the
// device leaves the next one first.
#include "models/optimizer.h"

namespace mpt::optim {

struct SGDOptions {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

class SGD : public Optimizer {
 public:
  SGD(std::vector<Tensor> params, const SGDOptions& options = {});
  SGD(std::vector<ParamGroup> groups, const SGDOptions& options = {});

  const SGDOptions& options() const { return options_; }

 protected:
  void update_group(const Group& group, std::vector<ParamUpdate>& batch) override;
  std::vector<std::string> buffer_names() const override { return {"momentum_buffer"}; }
  bool steps_make_buffers() const override { return options_.momentum != 0; }
  bool has_device_steps() const override { return true; }

 private:
  SGDOptions options_;
};

}  // namespace mpt::optim
