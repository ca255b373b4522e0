#pragma once
// Collectives among the devices of one process, for DataParallel: one
// tensor per device, all the same shape and dtype. On CUDA devices an NCCL
// clique made with ncclCommInitAll moves the data over NVLink/PCIe in a
// ring, so no card gathers everything; on (virtual) CPU devices the same
// calls run on the host, so the DataParallel logic is tested without GPUs.
#include <memory>
#include <vector>

#include "tensor/tensor.h"

namespace mpt::dist {

class LocalCommunicator {
 public:
  virtual ~LocalCommunicator() = default;
  // In place: every tensor becomes the sum of all of them.
  virtual void allreduce_sum(const std::vector<Tensor>& per_device) = 0;
  // In place: every tensor becomes per_device[root].
  virtual void broadcast(const std::vector<Tensor>& per_device, size_t root) = 0;

  // The same for many tensors at once (sets[k] holds tensor k of every
  // device): on GPUs one NCCL group call, so a model's parameters move in a
  // few fused launches instead of one collective each.
  virtual void allreduce_sum_all(const std::vector<std::vector<Tensor>>& sets) {
    for (const auto& per_device : sets) allreduce_sum(per_device);
  }
  virtual void broadcast_all(const std::vector<std::vector<Tensor>>& sets, size_t root) {
    for (const auto& per_device : sets) broadcast(per_device, root);
  }
};

// For `devices` (all CPU, or all CUDA). NotAvailableError for CUDA devices in
// a build without CUDA/NCCL.
std::unique_ptr<LocalCommunicator> new_local_communicator(const std::vector<Device>& devices);
// The CUDA one (parallel/cuda/, or the CPU build's stub).
std::unique_ptr<LocalCommunicator> new_nccl_local_communicator(const std::vector<Device>& devices);

}  // namespace mpt::dist
