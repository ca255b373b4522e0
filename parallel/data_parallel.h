#pragma once
// DataParallel: one process, several devices. Unlike PyTorch's nn.DataParallel:
//  - replicas stay resident on their devices; only the parameters are copied
//    to them, once per step, after the optimizer has updated the module;
//  - each device runs forward, its own loss and backward on its own
//    long-lived thread (grad mode, autocast and the training mode carried
//    over from the caller, random numbers from a fork of its generator), so
//    no card gathers every output;
//  - gradients are summed by a LocalCommunicator (an NCCL clique on GPUs),
//    not copied one by one to the first card.
//
// The wrapped module is replica 0 and lives on devices[0] (the optimizer
// owns its parameters); a module left on another device is an error, never
// a silent CPU run. On virtual CPU devices ("cpu:0", "cpu:1") the same code
// runs without GPUs.
#include <functional>
#include <memory>
#include <vector>

#include "amp/grad_scaler.h"
#include "models/module.h"
#include "parallel/local_communicator.h"
#include "parallel/device_threads.h"
#include "parallel/replicas.h"

namespace mpt::dist {

class DataParallel {
 public:
  // Builds a fresh module of the same architecture (its values are replaced
  // by the wrapped module's).
  using ModuleFactory = dist::ModuleFactory;
  // The mean loss over the rows of one device's share of the batch.
  using LossFn = std::function<Tensor(const Tensor& output, const Tensor& target)>;

  DataParallel(std::shared_ptr<nn::Module> module, const ModuleFactory& make_replica, std::vector<Device> devices);
  ~DataParallel();

  // Splits input and target along dim 0 over the devices (sizes differ by at
  // most one row; with fewer rows than devices the last ones sit out), runs
  // forward, loss and backward per device, and adds the gradient of the
  // whole batch's mean loss to the module's parameters, as one device would.
  // Returns that loss. With a scaler, the gradients are those of the scaled
  // loss (one scale() for the whole batch, counting its rows; each device
  // multiplies by the same scale), ready for scaler.step(optimizer). Grad
  // mode, autocast and TF32 settings carry into the device threads, each
  // device draws from a fork of the caller's default generator, and the
  // replicas take the module's training modes (train()/eval()) each call.
  // When a device fails the error is rethrown, and the module's gradients
  // may already hold part of this batch's: zero them before going on.
  double forward_backward(const Tensor& input, const Tensor& target, const LossFn& loss,
                          amp::GradScaler* scaler = nullptr);

  // Copies the module's parameters and buffers to the replicas. Done at the
  // start of every forward_backward (after the optimizer's step).
  void broadcast_parameters();

  nn::Module& module() { return *replicas_[0]; }
  const std::vector<Device>& devices() const { return devices_; }

 private:
  std::vector<Device> devices_;
  std::vector<std::shared_ptr<nn::Module>> replicas_;  // [0] is the wrapped module
  std::vector<std::vector<Tensor>> params_;            // [replica][parameter]
  std::vector<std::vector<Tensor>> buffers_;
  std::unique_ptr<LocalCommunicator> comm_;
  std::unique_ptr<DeviceThreads> threads_;
};

}  // namespace mpt::dist
