#include "parallel/launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <optional>

#include <fmt/format.h>

#include "parallel/orphan_guard.h"

namespace mpt::dist {

namespace {

volatile std::sig_atomic_t g_stop_signal = 0;
void on_stop_signal(int sig) { g_stop_signal = sig; }

// One of a rank's output streams, re-emitted line by line with a prefix.
struct Stream {
  int fd = -1;
  FILE* sink = nullptr;
  std::string partial;

  void emit(const std::string& prefix, const std::string& line) {
    fmt::print(sink, "{}{}\n", prefix, line);
    std::fflush(sink);
  }
  enum class Drained { empty, more, closed };
  // Reads what is there, up to 64 KiB: a rank that writes faster than we
  // re-emit must not keep the supervisor from its other duties (a dead
  // rank, a stop signal).
  Drained drain(const std::string& prefix) {
    char buf[4096];
    for (int reads = 0; reads < 16;) {
      const ssize_t n = ::read(fd, buf, sizeof buf);
      if (n > 0) {
        ++reads;
        partial.append(buf, static_cast<size_t>(n));
        size_t nl;
        while ((nl = partial.find('\n')) != std::string::npos) {
          emit(prefix, partial.substr(0, nl));
          partial.erase(0, nl + 1);
        }
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return Drained::empty;
      if (!partial.empty()) emit(prefix, partial);
      partial.clear();
      ::close(fd);
      fd = -1;
      return Drained::closed;
    }
    return Drained::more;
  }
};

struct Child {
  int rank = 0;
  pid_t pid = -1;
  bool running = true;
  int status = 0;
  Stream out, err;
  std::string prefix;
};

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exit status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("signal {} ({})", WTERMSIG(status), ::strsignal(WTERMSIG(status)));
  return fmt::format("status {}", status);
}

bool failed(int status) { return !WIFEXITED(status) || WEXITSTATUS(status) != 0; }

int exit_code_for(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status) != 0 ? WEXITSTATUS(status) : 1;
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

void start(Child& c, const std::vector<std::string>& command, const RankSpec& spec, pid_t launcher) {
  int out_pipe[2], err_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0)
    throw std::runtime_error(fmt::format("mpt-run: pipe() failed: {}", std::strerror(errno)));
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error(fmt::format("mpt-run: fork() failed: {}", std::strerror(errno)));
  if (pid == 0) {
    // The rank leads its own process group, so stopping it stops whatever it
    // started too; and it dies with the launcher (what it started dies by
    // the OrphanGuard), so none is orphaned.
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != launcher) ::_exit(125);  // the launcher died before prctl
    ::dup2(out_pipe[1], STDOUT_FILENO);
    ::dup2(err_pipe[1], STDERR_FILENO);
    // No terminal input: a rank, in a process group of its own, that read
    // the terminal would be stopped (SIGTTIN) and the job would hang.
    if (const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC); null_fd >= 0) ::dup2(null_fd, STDIN_FILENO);
    ::signal(SIGINT, SIG_DFL);
    ::signal(SIGTERM, SIG_DFL);
    for (const auto& [k, v] : spec.env) ::setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> argv;
    for (const auto& a : command) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execvp(argv[0], argv.data());
    std::fprintf(stderr, "mpt-run: cannot run '%s': %s\n", argv[0], std::strerror(errno));
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also here: no race with the first kill()
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  c.rank = spec.rank;
  c.pid = pid;
  c.prefix = fmt::format("[rank {}] ", spec.rank);
  c.out = Stream{out_pipe[0], stdout, {}};
  c.err = Stream{err_pipe[0], stderr, {}};
  ::fcntl(c.out.fd, F_SETFL, O_NONBLOCK);
  ::fcntl(c.err.fd, F_SETFL, O_NONBLOCK);
}

void signal_all(std::vector<Child>& children, int sig) {
  for (auto& c : children)
    if (c.running) ::kill(-c.pid, sig);
}

}  // namespace

LaunchOutcome supervise(const std::vector<std::string>& command, const std::vector<RankSpec>& ranks, double kill_grace_s) {
  using Clock = std::chrono::steady_clock;
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  // A hang-up stops the job unless it was started to outlive one (nohup
  // leaves SIGHUP ignored; the ranks inherit that too).
  struct sigaction hangup {};
  if (::sigaction(SIGHUP, nullptr, &hangup) != 0 || hangup.sa_handler != SIG_IGN) ::sigaction(SIGHUP, &sa, nullptr);
  // Started with SIGCHLD ignored (a parent may leave it so), the kernel
  // would reap the ranks itself, and waitpid() would never report them.
  ::signal(SIGCHLD, SIG_DFL);

  OrphanGuard orphan_guard;
  std::vector<Child> children(ranks.size());
  const pid_t self = ::getpid();
  for (size_t i = 0; i < ranks.size(); ++i) {
    start(children[i], command, ranks[i], self);
    orphan_guard.watch(children[i].pid);
  }

  LaunchOutcome outcome;
  std::optional<Clock::time_point> kill_deadline;  // set once we start stopping the ranks
  bool killed = false;
  auto begin_stop = [&] {
    if (kill_deadline) return;
    signal_all(children, SIGTERM);
    kill_deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(kill_grace_s));
  };

  for (;;) {
    // Output first, so a failing rank's last words come before our verdict.
    std::vector<pollfd> fds;
    std::vector<Stream*> streams;
    std::vector<const std::string*> prefixes;
    for (auto& c : children)
      for (Stream* s : {&c.out, &c.err})
        if (s->fd >= 0) {
          fds.push_back({s->fd, POLLIN, 0});
          streams.push_back(s);
          prefixes.push_back(&c.prefix);
        }
    if (!fds.empty()) ::poll(fds.data(), fds.size(), 50);
    else ::usleep(20000);
    for (size_t i = 0; i < fds.size(); ++i)
      if (fds[i].revents) streams[i]->drain(*prefixes[i]);

    // Ranks that failed since the last look. When several did, the others
    // usually failed because of one: a rank a signal killed (a crash, the
    // OOM killer) goes before ranks that exited with an error status, which
    // is how the survivors of a broken connection end.
    const Child* first_failed = nullptr;
    for (auto& c : children) {
      if (!c.running) continue;
      int status = 0;
      if (::waitpid(c.pid, &status, WNOHANG) != c.pid) continue;
      c.running = false;
      c.status = status;
      if (failed(status) && (first_failed == nullptr || (WIFSIGNALED(status) && !WIFSIGNALED(first_failed->status))))
        first_failed = &c;
    }
    if (first_failed != nullptr && outcome.failure.empty() && !kill_deadline) {
      outcome.failure = fmt::format("rank {} (pid {}) failed with {}", first_failed->rank, first_failed->pid,
                                    describe_status(first_failed->status));
      outcome.exit_code = exit_code_for(first_failed->status);
      begin_stop();
    }
    if (g_stop_signal && !kill_deadline) {
      outcome.failure = fmt::format("mpt-run received signal {} ({})", int(g_stop_signal), ::strsignal(g_stop_signal));
      outcome.exit_code = 128 + g_stop_signal;
      begin_stop();
    }
    if (kill_deadline && !killed && Clock::now() >= *kill_deadline) {
      signal_all(children, SIGKILL);
      killed = true;
    }
    bool any_running = false, any_open = false;
    for (auto& c : children) {
      any_running |= c.running;
      any_open |= c.out.fd >= 0 || c.err.fd >= 0;
    }
    if (!any_running) {
      // A rank's own children may hold its pipes open: give them up once
      // the ranks are gone and what was written has been read.
      if (any_open)
        for (auto& c : children) {
          // What is buffered, up to 4 MiB a stream (a rank's child may
          // still be writing).
          for (Stream* s : {&c.out, &c.err})
            for (int round = 0; round < 64 && s->fd >= 0; ++round)
              if (s->drain(c.prefix) != Stream::Drained::more) break;
          ::kill(-c.pid, SIGKILL);
          for (Stream* s : {&c.out, &c.err})
            if (s->fd >= 0) {
              ::close(s->fd);
              s->fd = -1;
            }
        }
      break;
    }
  }
  return outcome;
}

}  // namespace mpt::dist
