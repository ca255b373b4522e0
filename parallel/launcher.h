#pragma once
// The launcher behind mpt-run (as torchrun is PyTorch's): runs one process
// per local rank and watches them. Each line they print comes out prefixed
// with its rank, and the first rank that fails brings the others down
// (SIGTERM to each rank's process group, SIGKILL after a grace period), so
// no rank is left waiting on a dead peer. While it supervises, SIGINT and
// SIGTERM to the launcher stop the ranks the same way; killed outright,
// the launcher takes down what the ranks started too (orphan_guard.h).
#include <map>
#include <string>
#include <vector>

namespace mpt::dist {

struct RankSpec {
  int rank = 0;  // global rank, for the prefix and messages
  std::map<std::string, std::string> env;  // added to the launcher's environment
};

struct LaunchOutcome {
  int exit_code = 0;         // what mpt-run should exit with
  std::string failure;       // empty when every rank succeeded
};

// Starts `command` once per spec and supervises until all have exited.
// kill_grace_s: how long a rank may take to exit after SIGTERM.
LaunchOutcome supervise(const std::vector<std::string>& command, const std::vector<RankSpec>& ranks, double kill_grace_s);

}  // namespace mpt::dist
