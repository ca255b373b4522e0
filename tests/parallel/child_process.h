#pragma once
// A program started in the background with extra environment variables and
// its output in a file, for tests that hurt it (SIGKILL) and time how the
// others react. Every wait is bounded; the destructor kills what is left.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace mpt::testing {

class ChildProcess {
 public:
  ChildProcess(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
               std::string log_path)
      : log_path_(std::move(log_path)) {
    pid_ = ::fork();
    if (pid_ == 0) {
      // Its own process group, so a kill reaches what it starts too.
      ::setpgid(0, 0);
      std::FILE* log = std::fopen(log_path_.c_str(), "w");
      if (log == nullptr) ::_exit(126);
      ::dup2(::fileno(log), STDOUT_FILENO);
      ::dup2(::fileno(log), STDERR_FILENO);
      for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execvp(args[0], args.data());
      ::_exit(127);
    }
  }
  ~ChildProcess() {
    if (pid_ > 0 && !status_) {
      ::kill(-pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  void signal(int sig) const { ::kill(pid_, sig); }
  void signal_group(int sig) const { ::kill(-pid_, sig); }

  // The wait status once it has exited, or nothing after `seconds`.
  std::optional<int> wait(double seconds) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (!status_) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        status_ = status;
        break;
      }
      if (std::chrono::steady_clock::now() >= until) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return status_;
  }

  std::string output() const {
    std::ifstream in(log_path_);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }

  // Waits until its output contains `text`; false after `seconds`.
  bool wait_for_output(const std::string& text, double seconds) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    for (;;) {
      if (output().find(text) != std::string::npos) return true;
      if (std::chrono::steady_clock::now() >= until || wait(0)) return output().find(text) != std::string::npos;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

 private:
  pid_t pid_ = -1;
  std::string log_path_;
  std::optional<int> status_;
};

inline bool exited_with_failure(int status) { return !WIFEXITED(status) || WEXITSTATUS(status) != 0; }

}  // namespace mpt::testing
