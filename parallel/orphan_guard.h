#pragma once
// OrphanGuard: no process a rank started outlives a launcher that was
// killed outright (SIGKILL, the OOM killer). Each rank dies with the
// launcher (PR_SET_PDEATHSIG), but what the rank started (data-loading
// workers, a shell's children) would not: it would hold GPU memory and
// ports with no one left to stop it. The guard is a small process forked
// before the ranks; the launcher tells it each rank's process group
// through a socket, and when that socket closes without the launcher
// saying the job is over, the guard kills those groups.
#include <sys/types.h>

namespace mpt::dist {

class OrphanGuard {
 public:
  OrphanGuard();   // forks the guard
  ~OrphanGuard();  // the job is over: the guard exits and kills nothing
  OrphanGuard(const OrphanGuard&) = delete;
  OrphanGuard& operator=(const OrphanGuard&) = delete;

  // A rank's process group, to be killed if the launcher dies.
  void watch(pid_t process_group);

 private:
  int to_guard_ = -1;  // the launcher's end of the socket
  pid_t guard_ = -1;
};

}  // namespace mpt::dist
