#include "models/sgd.h"

#include <cmath>

#include "models/fused_optim.h"
#include "tensor/device_guard.h"
#include "tensor/ops.h"

namespace mpt::optim {
namespace {

const SGDOptions& validated(const SGDOptions& o) {
  check(std::isfinite(o.momentum) && o.momentum >= 0, "SGD: invalid momentum {} (must be >= 0)", o.momentum);
  check(std::isfinite(o.dampening), "SGD: invalid dampening {}", o.dampening);
  // Nesterov looks ahead along the momentum buffer; without momentum, or
  // with a damped buffer, the formula is not Nesterov's (PyTorch refuses too).
  check(!o.nesterov || (o.momentum > 0 && o.dampening == 0),
        "SGD: nesterov needs momentum > 0 and dampening 0, got momentum {} dampening {}", o.momentum, o.dampening);
  return o;
}

}  // namespace

SGD::SGD(std::vector<Tensor> params, const SGDOptions& options)
    : SGD(std::vector<ParamGroup>{ParamGroup{std::move(params), std::nullopt, std::nullopt}}, options) {}

SGD::SGD(std::vector<ParamGroup> groups, const SGDOptions& options)
    : Optimizer("SGD", std::move(groups), options.lr, options.weight_decay), options_(validated(options)) {}

void SGD::update_group(const Group& group, std::vector<ParamUpdate>& batch) {
  const SGDOptions& o = options_;
  if (can_fuse(batch)) {
    // Capturable mode: counts, hyper-parameters and the skip decision on the
    // device.
    const bool device_steps = capturable();
    std::vector<fused::SGDTensor> tensors;
    std::vector<float*> steps;
    for (ParamUpdate& u : batch) {
      const Tensor& p = u.param;
      void* buffer = nullptr;
      bool first = false;
      if (o.momentum != 0) {
        Tensor* buf = u.state->buffers.find("momentum_buffer");
        first = buf == nullptr;
        if (first) {
          // Zeros in capturable mode: a first update skipped on the device
          // leaves the buffer as it was made, and the state dict holds it.
          Tensor made = device_steps ? zeros(p.shape(), p.dtype(), p.device())
                                     : Tensor::empty(p.shape(), p.dtype(), p.device());
          buf = &u.state->buffers.insert("momentum_buffer", std::move(made));
        }
        buffer = buf->data_ptr();
      }
      fused::SGDTensor t{p.data_ptr(), u.grad.data_ptr(), buffer, p.numel(), first};
      if (device_steps) {
        t.step = u.state->device_step.data<float>();
        steps.push_back(u.state->device_step.data<float>());
      }
      tensors.push_back(t);
    }
    fused::SGDScalars scalars{static_cast<float>(group.lr), static_cast<float>(group.weight_decay),
                              static_cast<float>(o.momentum), static_cast<float>(1.0 - o.dampening), o.nesterov};
    if (device_steps) scalars.hyper = group.hyper_on_device.data<float>();
    if (found_inf().defined()) scalars.found_inf = found_inf().data<float>();
    const Device device = batch.front().param.device();
    if (device.is_cpu()) {
      fused::sgd_on_host(batch.front().param.dtype(), tensors, scalars);
      return;
    }
    DeviceGuard guard(device);
    fused::sgd(batch.front().param.dtype(), tensors, scalars);
    if (device_steps) fused::advance_steps(steps, scalars.found_inf);
    return;
  }
  check(!capturable(), "SGD: capturable mode needs the fused kernel, but this group cannot use it");

  for (ParamUpdate& u : batch) {
    const Tensor& p = u.param;
    // d starts as the gradient itself (read only: it may be p.grad()).
    Tensor d = u.grad;
    if (group.weight_decay != 0) d = prim::add(d, prim::mul_scalar(p, group.weight_decay));
    if (o.momentum != 0) {
      Tensor* buf = u.state->buffers.find("momentum_buffer");
      if (buf == nullptr) {
        buf = &u.state->buffers.insert("momentum_buffer", prim::clone(d));
      } else {
        prim::unary_(UnaryOp::affine, *buf, *buf, o.momentum, 0.0);
        prim::binary_(BinaryOp::add, *buf, *buf, prim::mul_scalar(d, 1.0 - o.dampening));
      }
      d = o.nesterov ? prim::add(d, prim::mul_scalar(*buf, o.momentum)) : *buf;
    }
    prim::binary_(BinaryOp::add, p, p, prim::mul_scalar(d, -group.lr));
  }
}

}  // namespace mpt::optim
