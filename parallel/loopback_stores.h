#pragma once
// Stores for ranks that run as threads of this process (ReplicaGroup,
// mpt-doctor's Gloo check, the tests): [0] hosts the server on the loopback
// interface, on a port the system picks, and the others are its clients.
// All carry one random job token, so no other process can join by mistake.
// Each rank then makes its process group over its own store (its own TCP
// connection), as separate processes would.
#include <memory>
#include <vector>

#include "parallel/store.h"

namespace mpt::dist {

std::vector<std::shared_ptr<Store>> loopback_stores(int world, Millis timeout = kDefaultTimeout);

}  // namespace mpt::dist
