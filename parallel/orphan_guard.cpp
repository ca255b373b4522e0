#include "parallel/orphan_guard.h"

#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <vector>

#include <fmt/format.h>

namespace mpt::dist {

namespace {

// What the launcher sends: a process group to watch, or kJobOver. The
// socket keeps messages whole, and a send to a guard that is gone fails
// with EPIPE instead of raising SIGPIPE in the launcher.
constexpr pid_t kJobOver = 0;

[[noreturn]] void guard_main(int from_launcher) {
  // Ctrl-C reaches the launcher's whole process group, this process too:
  // stopping the job is the launcher's to do, and it tells us when it is over.
  ::signal(SIGINT, SIG_IGN);
  ::signal(SIGTERM, SIG_IGN);
  ::signal(SIGHUP, SIG_IGN);
  // Hold nothing else of the launcher's open (a pipe to `tee` would wait for us).
  if (from_launcher > 0) ::close_range(0, static_cast<unsigned>(from_launcher) - 1, 0);
  ::close_range(static_cast<unsigned>(from_launcher) + 1, ~0U, 0);
  std::vector<pid_t> groups;
  for (;;) {
    pid_t message = 0;
    const ssize_t n = ::recv(from_launcher, &message, sizeof message, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n != static_cast<ssize_t>(sizeof message)) break;  // the launcher is gone without a word
    if (message == kJobOver) ::_exit(0);
    groups.push_back(message);
  }
  for (const pid_t group : groups) ::kill(-group, SIGKILL);
  ::_exit(0);
}

void send_message(int fd, pid_t message) {
  for (;;) {
    const ssize_t n = ::send(fd, &message, sizeof message, MSG_NOSIGNAL);
    if (n == static_cast<ssize_t>(sizeof message)) return;
    if (n < 0 && errno == EINTR) continue;
    throw std::runtime_error(fmt::format("mpt-run: cannot reach its orphan guard: {}", std::strerror(errno)));
  }
}

}  // namespace

OrphanGuard::OrphanGuard() {
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fds) != 0)
    throw std::runtime_error(fmt::format("mpt-run: socketpair() failed: {}", std::strerror(errno)));
  guard_ = ::fork();
  if (guard_ < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    throw std::runtime_error(fmt::format("mpt-run: fork() failed: {}", std::strerror(errno)));
  }
  if (guard_ == 0) {
    ::close(fds[1]);
    guard_main(fds[0]);
  }
  ::close(fds[0]);
  to_guard_ = fds[1];
}

OrphanGuard::~OrphanGuard() {
  try {
    send_message(to_guard_, kJobOver);
  } catch (const std::exception&) {
    // The guard is gone already; nothing is left for it to do.
  }
  ::close(to_guard_);
  int status = 0;
  while (::waitpid(guard_, &status, 0) < 0 && errno == EINTR) {
  }
}

void OrphanGuard::watch(pid_t process_group) { send_message(to_guard_, process_group); }

}  // namespace mpt::dist
