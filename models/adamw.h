#pragma once
// Adam with decoupled weight decay, PyTorch's exact rule (torch.optim.AdamW,
// amsgrad off). With t the parameter's own step count:
//   p = p * (1 - lr * weight_decay)
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g^2
//   p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// State: "exp_avg" (m), "exp_avg_sq" (v), both zero before the first step.
#include <memory>
#include <unordered_map>
#include <unordered_set>

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

  // Yes for a contiguous f32 [rows, cols] weight on a CUDA device (sizes of
  // 16), with fusion on, under delayed scaling with no observer on the
  // scaling state (current scaling needs the new weight's amax before its
  // scale; an observer must see each quantization), and the layer's copies
  // made once already (their buffers are written in place).
  bool write_fp8_copies(const Tensor& param, std::shared_ptr<amp::Fp8LinearState> layer) override;

 protected:
  void update_group(const Group& group, std::vector<ParamUpdate>& batch) override;
  void after_update(const std::vector<ParamUpdate>& batch) override;
  std::vector<std::string> buffer_names() const override { return {"exp_avg", "exp_avg_sq"}; }
  bool has_device_steps() const override { return true; }

 private:
  AdamWOptions options_;
  // The layers whose FP8 weight copies the fused step writes, by weight
  // (its TensorImpl), and those it wrote in the current step.
  std::unordered_map<const void*, std::shared_ptr<amp::Fp8LinearState>> fp8_copies_;
  std::unordered_set<const void*> fp8_written_;
};

}  // namespace mpt::optim
