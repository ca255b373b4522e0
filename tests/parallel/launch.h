#pragma once
// Runs mpt-run on the ddp_worker test program and collects what it printed.
// Both binaries are found beside the test binary (the build tree may have
// been copied elsewhere, e.g. to a GPU machine); the configured paths are
// the fallback.
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "parallel/child_process.h"
#include "parallel/free_port.h"
#include "tests/test_util.h"

namespace mpt::testing {

inline std::string mpt_run_path() { return build_file("../tools/mpt-run/mpt-run", MPT_RUN_PATH); }
inline std::string ddp_worker_path() { return build_file("ddp_worker", DDP_WORKER_PATH); }

struct JobResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr
  double seconds = 0;
};

inline JobResult run_shell(const std::string& cmd) {
  const auto start = std::chrono::steady_clock::now();
  JobResult r;
  FILE* pipe = ::popen((cmd + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) r.output.append(buf, n);
  const int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

// `nproc` ranks of ddp_worker in `mode` (see tests/parallel/ddp_worker.cpp);
// `env`: assignments put before the command ("MPT_TEST_PEER_COLLECTIVES=1").
inline JobResult run_job(const std::string& mode, int nproc = 2, const std::string& env = "") {
  return run_shell(fmt::format("{} '{}' --nproc_per_node {} --master_port {} --kill_timeout 2 '{}' {}", env,
                               mpt_run_path(), nproc, free_port(), ddp_worker_path(), mode));
}

// `world` ranks of ddp_worker started directly (no launcher, so nobody
// stops a survivor for it), meeting at a free local port: `args` follow the
// program, collectives time out after `timeout_s`, `env` adds variables,
// and rank r writes its output to log_of(r).
inline std::vector<std::unique_ptr<ChildProcess>> start_worker_ranks(
    int world, const std::vector<std::string>& args, int timeout_s, const std::map<std::string, std::string>& env,
    const std::function<std::string(int)>& log_of) {
  const std::string port = std::to_string(free_port());
  std::vector<std::string> argv = {ddp_worker_path()};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<std::unique_ptr<ChildProcess>> ranks;
  for (int r = 0; r < world; ++r) {
    std::map<std::string, std::string> vars = env;
    vars["RANK"] = std::to_string(r);
    vars["WORLD_SIZE"] = std::to_string(world);
    vars["MASTER_ADDR"] = "127.0.0.1";
    vars["MASTER_PORT"] = port;
    vars["MPT_TEST_TIMEOUT_S"] = std::to_string(timeout_s);
    ranks.push_back(std::make_unique<ChildProcess>(argv, vars, log_of(r)));
  }
  return ranks;
}

}  // namespace mpt::testing
