#pragma once
// A process group that picks its backend by each tensor's device: Gloo for
// CPU tensors, NCCL for CUDA tensors (on the tensor's GPU). The backend
// groups are made on first use; every rank makes them at the same point of
// its (identical) sequence of collectives, so they meet. This is what
// init_process_group() returns, so DDP on GPUs can still send a CPU tensor.
#include <memory>
#include <mutex>

#include "parallel/process_group.h"
#include "parallel/rendezvous.h"

namespace mpt::dist {

class DeviceRoutedGroup : public ProcessGroup {
 public:
  DeviceRoutedGroup(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options);

  std::string backend_name() const override { return "gloo (cpu) / nccl (cuda)"; }
  WorkPtr allreduce(const Tensor& tensor, ReduceOp op) override;
  WorkPtr broadcast(const Tensor& tensor, int root) override;
  WorkPtr allgather(const std::vector<Tensor>& outputs, const Tensor& input) override;
  WorkPtr reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp op) override;
  // On the CPU group (made on demand).
  WorkPtr barrier() override;
  Tensor registered_buffer(int64_t numel, DType dtype, const Device& device) override;

  // The backend serving tensors on `device`, made on first use.
  ProcessGroup& backend_for(const Device& device);

 private:
  std::shared_ptr<Store> store_;
  ProcessGroupOptions options_;
  std::mutex mutex_;
  std::shared_ptr<ProcessGroup> cpu_;
  std::shared_ptr<ProcessGroup> cuda_;
  int cuda_device_ = -1;
};

// Rendezvous (see rendezvous()) and a DeviceRoutedGroup over its store.
struct Distributed {
  RendezvousConfig config;
  std::shared_ptr<Store> store;
  std::shared_ptr<DeviceRoutedGroup> group;
};
Distributed init_process_group(const std::string& url = "env://", const ProcessGroupOptions& options = {},
                               const EnvLookup& env = process_env);

}  // namespace mpt::dist
