#include "parallel/data_parallel.h"

#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "models/training_mode.h"
#include "tensor/device_guard.h"
#include "tensor/nvtx.h"
#include "tensor/ops.h"
#include "tensor/step_timer.h"

namespace mpt::dist {

namespace {

std::vector<Tensor> values_of(const OrderedDict<Tensor>& dict) {
  std::vector<Tensor> out;
  for (const auto& [name, t] : dict) out.push_back(t);
  return out;
}

}  // namespace

DataParallel::DataParallel(std::shared_ptr<nn::Module> module, const ModuleFactory& make_replica_module,
                           std::vector<Device> devices)
    : devices_(std::move(devices)) {
  check<ValueError>(module != nullptr, "DataParallel: null module");
  check_replica_devices(*module, devices_, "DataParallel");
  replicas_.push_back(std::move(module));
  for (size_t i = 1; i < devices_.size(); ++i)
    replicas_.push_back(make_replica(make_replica_module, *replicas_[0], devices_[i], "DataParallel"));
  for (auto& r : replicas_) {
    params_.push_back(values_of(r->named_parameters()));
    buffers_.push_back(values_of(r->named_buffers()));
  }
  comm_ = new_local_communicator(devices_);
  threads_ = std::make_unique<DeviceThreads>(devices_);
}

DataParallel::~DataParallel() = default;

void DataParallel::broadcast_parameters() {
  NoGradGuard no_grad;
  std::vector<std::vector<Tensor>> sets;
  for (size_t k = 0; k < params_[0].size(); ++k) {
    sets.emplace_back();
    for (auto& p : params_) sets.back().push_back(p[k]);
  }
  for (size_t k = 0; k < buffers_[0].size(); ++k) {
    sets.emplace_back();
    for (auto& b : buffers_) sets.back().push_back(b[k]);
  }
  comm_->broadcast_all(sets, 0);
}

double DataParallel::forward_backward(const Tensor& input, const Tensor& target, const LossFn& loss,
                                      amp::GradScaler* scaler) {
  const size_t n = devices_.size();
  check<ShapeError>(input.dim() >= 1 && target.dim() >= 1 && input.size(0) == target.size(0),
                    "DataParallel::forward_backward: input {} and target {} need the same batch size in dim 0",
                    describe(input), describe(target));
  const int64_t batch = input.size(0);
  check<ShapeError>(batch >= 1, "DataParallel::forward_backward: an empty batch ({})", describe(input));
  // Phases, when a step timer runs: the parameter broadcast and the
  // gradient sum are communication; device 0's thread marks its forward
  // and backward; waiting for slower devices counts as communication.
  StepTimer* timer = StepTimer::active();
  {
    NvtxRange range("dp: broadcast parameters");
    broadcast_parameters();
  }
  if (timer) timer->lap(StepPhase::comm);
  for (size_t i = 1; i < n; ++i) {
    for (auto& p : params_[i]) p.set_grad(Tensor());  // replicas hold only this step's gradients
    nn::copy_training_modes(*replicas_[0], *replicas_[i]);
  }

  // One scale() call for the batch (the scaler counts it once and places
  // its state); the devices then read the same scale.
  Tensor scale;
  if (scaler && scaler->is_enabled()) {
    scaler->scale(full({}, 1.0, DType::f32, devices_[0]), batch);
    scale = scaler->scale_tensor();
  }
  std::vector<Tensor> losses(n);
  std::vector<double> weights(n, 0.0);
  std::vector<int64_t> begins(n + 1, 0);
  for (size_t i = 0; i < n; ++i) {  // sizes differ by at most one row
    const auto count = static_cast<int64_t>(n), index = static_cast<int64_t>(i);
    begins[i + 1] = begins[i] + batch / count + (index < batch % count);
  }
  threads_->run([&](size_t i) {
    const int64_t begin = begins[i], rows = begins[i + 1] - begins[i];
    if (rows == 0) return;  // a batch smaller than the devices: this one adds zeros
    const Tensor x = prim::to(prim::slice(input, 0, begin, begin + rows), devices_[i]);
    const Tensor y = prim::to(prim::slice(target, 0, begin, begin + rows), devices_[i]);
    const Tensor l = loss(replicas_[i]->forward(x), y);
    check<ShapeError>(l.numel() == 1, "DataParallel: the loss on {} is {}, not a scalar", devices_[i].str(),
                      describe(l));
    // d(batch mean)/d(device mean) = rows / batch.
    const double weight = static_cast<double>(rows) / static_cast<double>(batch);
    if (timer && i == 0) timer->lap(StepPhase::forward);
    losses[i] = detach(l);
    weights[i] = weight;
    if (grad_enabled()) {
      Tensor seed = full(l.shape(), weight, l.dtype(), devices_[i]);
      if (scale.defined()) seed = prim::mul(seed, prim::reshape(prim::to(prim::to(scale, devices_[i]), l.dtype()), {}));
      backward(l, seed);
    }
    if (timer && i == 0) timer->lap(StepPhase::backward);
  });

  NoGradGuard no_grad;
  std::vector<std::vector<Tensor>> grads;
  for (size_t k = 0; k < params_[0].size(); ++k) {
    bool any = false;
    for (auto& p : params_) any |= p[k].grad().defined();
    if (!any) continue;
    grads.emplace_back();
    for (auto& p : params_) {
      if (!p[k].grad().defined()) p[k].set_grad(zeros(p[k].shape(), p[k].dtype(), p[k].device()));
      grads.back().push_back(p[k].grad());
    }
  }
  {
    NvtxRange range("dp: all-reduce gradients");
    comm_->allreduce_sum_all(grads);
  }
  if (timer) timer->lap(StepPhase::comm);
  // Read last, so no device waited for the host before its backward ran.
  double total = 0;
  for (size_t i = 0; i < n; ++i)
    if (losses[i].defined()) total += losses[i].item() * weights[i];
  return total;
}

}  // namespace mpt::dist
