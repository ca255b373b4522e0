#include "parallel/replica_group.h"

#include "parallel/device_routed_group.h"
#include "parallel/loopback_stores.h"

namespace mpt::dist {

ReplicaGroup::ReplicaGroup(std::shared_ptr<nn::Module> module, const ModuleFactory& make_replica_module,
                           std::vector<Device> devices, ReplicaGroupOptions options) {
  check<ValueError>(module != nullptr, "ReplicaGroup: null module");
  check_replica_devices(*module, devices, "ReplicaGroup");
  for (size_t i = 0; i < devices.size(); ++i) {
    auto r = std::make_unique<Replica>();
    r->rank = i;
    r->device = devices[i];
    r->module = i == 0 ? module : make_replica(make_replica_module, *module, devices[i], "ReplicaGroup");
    replicas_.push_back(std::move(r));
  }
  threads_ = std::make_unique<DeviceThreads>(devices);

  const int world = static_cast<int>(devices.size());
  stores_ = loopback_stores(world, options.timeout);
  ProcessGroupOptions group_options;
  group_options.timeout = options.timeout;
  group_options.hostname = "127.0.0.1";
  group_options.peer_collectives = options.peer_collectives;
  // Together: each rank's group and DDP wait for the others to join.
  threads_->run([&](size_t i) {
    Replica& r = *replicas_[i];
    r.group = std::make_shared<DeviceRoutedGroup>(stores_[i], static_cast<int>(i), world, group_options);
    r.ddp = std::make_unique<DistributedDataParallel>(r.module, r.group, options.ddp);
  });
}

ReplicaGroup::~ReplicaGroup() {
  // Each rank lets go of its communicators on its own thread, all at once:
  // tearing down one NCCL rank of an in-process clique may wait for its peers.
  try {
    threads_->run([&](size_t i) {
      replicas_[i]->ddp.reset();
      replicas_[i]->group.reset();
    });
  } catch (...) {
    // A destructor cannot throw; what is left goes with the members.
  }
}

void ReplicaGroup::run(const std::function<void(Replica&)>& fn) {
  threads_->run([&](size_t i) { fn(*replicas_[i]); });
}

}  // namespace mpt::dist
