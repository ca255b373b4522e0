#pragma once
// ReplicaGroup: DistributedDataParallel without processes. Each device of
// this process holds a replica of the module and a long-lived thread; each
// thread is a rank of an in-process group (NCCL on GPUs, Gloo on virtual CPU
// devices such as "cpu:0", "cpu:1") and wraps its replica in
// DistributedDataParallel. run(fn) runs fn on every thread at once, so each
// replica trains its share of the batch with its own optimizer and loss
// scaler: gradients are averaged in buckets while backward runs, every
// replica then applies the same update to the same values, and nothing is
// broadcast per step. A replica's step may be a CapturedStep (one CUDA
// graph per device, captured and launched by that device's thread, the way
// NCCL asks for graphs over several GPUs of one process).
//
// Against DataParallel (one optimizer owning the wrapped module): no
// parameter broadcast per step, communication hidden behind backward, and
// graph capture; the price is one optimizer state per device.
//
// A replica whose fn throws leaves its peers waiting in their next
// collective until the group's timeout ends it (bounded, with an error
// naming the collective); a collective replayed inside a CUDA graph has no
// such bound.
#include <functional>
#include <memory>
#include <vector>

#include "parallel/device_threads.h"
#include "parallel/distributed_data_parallel.h"
#include "parallel/process_group.h"
#include "parallel/replicas.h"
#include "parallel/store.h"

namespace mpt::dist {

struct Replica {
  size_t rank = 0;  // index into the group's devices
  Device device;
  std::shared_ptr<nn::Module> module;
  std::shared_ptr<ProcessGroup> group;  // this replica's rank of the in-process group
  std::unique_ptr<DistributedDataParallel> ddp;
};

struct ReplicaGroupOptions {
  DdpOptions ddp;
  Millis timeout = kDefaultTimeout;  // for every collective of the group
  // The replicas' NCCL groups all-reduce registered buckets by their own
  // kernel (ProcessGroupOptions::peer_collectives; with ddp.registered_buffers).
  bool peer_collectives = false;
};

class ReplicaGroup {
 public:
  // `module` must live on devices[0] and becomes replica 0; make_replica
  // builds the others (their values are replaced by the module's).
  ReplicaGroup(std::shared_ptr<nn::Module> module, const ModuleFactory& make_replica, std::vector<Device> devices,
               ReplicaGroupOptions options = {});
  ~ReplicaGroup();
  ReplicaGroup(const ReplicaGroup&) = delete;
  ReplicaGroup& operator=(const ReplicaGroup&) = delete;

  // fn(replica) for every replica at once, each on its device's thread with
  // that device current and the caller's grad mode and autocast settings.
  // Returns when all have finished; then rethrows the first error.
  void run(const std::function<void(Replica&)>& fn);

  size_t size() const { return replicas_.size(); }
  Replica& replica(size_t rank) { return *replicas_.at(rank); }
  nn::Module& module() { return *replicas_[0]->module; }

 private:
  std::vector<std::shared_ptr<Store>> stores_;  // where the ranks met; outlive their groups
  std::vector<std::unique_ptr<Replica>> replicas_;
  std::unique_ptr<DeviceThreads> threads_;
};

}  // namespace mpt::dist
