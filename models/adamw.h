#pragma once
// Adam with decoupled weight decay, PyTorch's exact rule (torch.optim.AdamW,
// amsgrad off). With t the parameter's own step count:
//   p = p * (1 - lr * weight_decay)
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g^2
//   p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// State: "exp_avg" (m), "exp_avg_sq" (v), both zero before the first step.
#include "models/optimizer.h"

namespace mpt::optim {

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};

class AdamW : public Optimizer {
 public:
  AdamW(std::vector<Tensor> params, const AdamWOptions& options = {});
  AdamW(std::vector<ParamGroup> groups, const AdamWOptions& options = {});

  const AdamWOptions& options() const { return options_; }

 protected:
  void update_group(const Group& group, std::vector<ParamUpdate>& batch) override;
  std::vector<std::string> buffer_names() const override { return {"exp_avg", "exp_avg_sq"}; }
  bool has_device_steps() const override { return true; }

 private:
  AdamWOptions options_;
};

}  // namespace mpt::optim
