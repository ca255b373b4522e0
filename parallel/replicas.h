#pragma once
// Placing a module's replicas on several devices of one process, shared by
// DataParallel and ReplicaGroup: the devices must be of one type, distinct
// and present, the wrapped module must already live on devices[0] (its
// optimizer may own its parameters), and each replica is a fresh module of
// the same architecture holding the wrapped module's values.
#include <functional>
#include <memory>
#include <vector>

#include "models/module.h"

namespace mpt::dist {

using ModuleFactory = std::function<std::shared_ptr<nn::Module>()>;

// `who` names the caller in the errors ("DataParallel").
void check_replica_devices(const nn::Module& module, const std::vector<Device>& devices, const char* who);

// make() on `device`, with `source`'s parameters, buffers and training mode.
std::shared_ptr<nn::Module> make_replica(const ModuleFactory& make, const nn::Module& source, const Device& device,
                                         const char* who);

}  // namespace mpt::dist
