#include "parallel/device_routed_group.h"

#include "parallel/gloo_process_group.h"
#include "parallel/nccl_process_group.h"

namespace mpt::dist {

DeviceRoutedGroup::DeviceRoutedGroup(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options)
    : ProcessGroup(rank, size), store_(std::move(store)), options_(std::move(options)) {
  check<ValueError>(store_ != nullptr, "DeviceRoutedGroup: null store");
}

ProcessGroup& DeviceRoutedGroup::backend_for(const Device& device) {
  std::lock_guard lock(mutex_);
  if (device.is_cpu()) {
    if (!cpu_) cpu_ = new_gloo_process_group(store_, rank(), size(), options_);
    return *cpu_;
  }
  if (!cuda_) {
    cuda_ = new_nccl_process_group(store_, rank(), size(), device.index, options_);
    cuda_device_ = device.index;
  }
  check<DeviceError>(device.index == cuda_device_,
                     "process group (rank {}): a tensor on {} but this rank's NCCL group drives cuda:{}; one GPU per "
                     "rank",
                     rank(), device.str(), cuda_device_);
  return *cuda_;
}

WorkPtr DeviceRoutedGroup::allreduce(const Tensor& tensor, ReduceOp op) {
  check<ValueError>(tensor.defined(), "allreduce: undefined tensor");
  return backend_for(tensor.device()).allreduce(tensor, op);
}

WorkPtr DeviceRoutedGroup::broadcast(const Tensor& tensor, int root) {
  check<ValueError>(tensor.defined(), "broadcast: undefined tensor");
  return backend_for(tensor.device()).broadcast(tensor, root);
}

WorkPtr DeviceRoutedGroup::allgather(const std::vector<Tensor>& outputs, const Tensor& input) {
  check<ValueError>(input.defined(), "allgather: undefined input");
  return backend_for(input.device()).allgather(outputs, input);
}

WorkPtr DeviceRoutedGroup::reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp op) {
  check<ValueError>(input.defined(), "reduce_scatter: undefined input");
  return backend_for(input.device()).reduce_scatter(output, input, op);
}

WorkPtr DeviceRoutedGroup::barrier() { return backend_for(kCPU).barrier(); }

Tensor DeviceRoutedGroup::registered_buffer(int64_t numel, DType dtype, const Device& device) {
  return backend_for(device).registered_buffer(numel, dtype, device);
}

Distributed init_process_group(const std::string& url, const ProcessGroupOptions& options, const EnvLookup& env) {
  Rendezvous rv = rendezvous(url, options.timeout, env);
  Distributed d;
  d.config = rv.config;
  d.store = rv.store;
  d.group = std::make_shared<DeviceRoutedGroup>(rv.store, rv.config.rank, rv.config.world_size, options);
  return d;
}

}  // namespace mpt::dist
