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
    std::vector<fused::SGDTensor> tensors;
    for (ParamUpdate& u : batch) {
      const Tensor& p = u.param;
      void* buffer = nullptr;
      bool first = false;
      if (o.momentum != 0) {
        Tensor* buf = u.state->buffers.find("momentum_buffer");
        first = buf == nullptr;
        if (first) buf = &u.state->buffers.insert("momentum_buffer", Tensor::empty(p.shape(), p.dtype(), p.device()));
        buffer = buf->data_ptr();
      }
      tensors.push_back({p.data_ptr(), u.grad.data_ptr(), buffer, p.numel(), first});
    }
    DeviceGuard guard(batch.front().param.device());
    fused::sgd(batch.front().param.dtype(), tensors,
               {static_cast<float>(group.lr), static_cast<float>(group.weight_decay), static_cast<float>(o.momentum),
                static_cast<float>(o.dampening), o.nesterov});
    return;
  }
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
