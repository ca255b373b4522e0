// mpt-run end to end: two ranks on Gloo train with DDP and match one
// process on the concatenated batch; a failing rank brings the job down
// quickly, named, with no process left behind.
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <regex>
#include <string>

#include <fmt/format.h>

#include "parallel/free_port.h"
#include "test_util.h"

namespace {

struct Result {
  int exit_code = -1;
  std::string output;  // stdout and stderr
  double seconds = 0;
};

Result run_job(const std::string& mode, int nproc = 2) {
  const std::string cmd = fmt::format("'{}' --nproc_per_node {} --master_port {} --kill_timeout 2 '{}' {} 2>&1",
                                      MPT_RUN_PATH, nproc, mpt::testing::free_port(), DDP_WORKER_PATH, mode);
  const auto start = std::chrono::steady_clock::now();
  Result r;
  FILE* pipe = ::popen(cmd.c_str(), "r");
  EXPECT_NE(pipe, nullptr);
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) r.output.append(buf, n);
  const int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

}  // namespace

TEST(Launcher, DdpPlainStepsMatchOneProcess) {
  const Result r = run_job("plain");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 0] rank 0: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 1] rank 1: "), std::string::npos) << r.output;
}

TEST(Launcher, DdpNoSyncAccumulationMatchesOneProcess) {
  const Result r = run_job("accum");
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

TEST(Launcher, DdpWithBf16CompressionStaysClose) {
  const Result r = run_job("compress");
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

TEST(Launcher, DdpUnusedParametersAreReportedOrDetected) {
  const Result r = run_job("unused");
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

TEST(Launcher, ThreeRanksAlsoMatch) {
  const Result r = run_job("plain", 3);
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

TEST(Launcher, AFailingRankStopsTheJobNamingIt) {
  const Result r = run_job("die");
  EXPECT_EQ(r.exit_code, 7) << r.output;
  EXPECT_NE(r.output.find("rank 1 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("exit status 7"), std::string::npos) << r.output;
  // Rank 0 would sleep for a minute: mpt-run stopped it (grace 2 s).
  EXPECT_LT(r.seconds, 20.0) << r.output;
  // ... and it is gone, not orphaned.
  std::smatch m;
  const std::regex rank0_pid(R"(\[rank 0\] rank 0 of 2 ready, pid (\d+))");
  ASSERT_TRUE(std::regex_search(r.output, m, rank0_pid)) << r.output;
  EXPECT_NE(::kill(std::stoi(m[1]), 0), 0) << "rank 0 (pid " << m[1] << ") is still alive";
}

TEST(Launcher, AMissingProgramIsAClearFailure) {
  const std::string cmd =
      fmt::format("'{}' --nproc_per_node 1 --master_port {} /nonexistent/program 2>&1", MPT_RUN_PATH,
                  mpt::testing::free_port());
  FILE* pipe = ::popen(cmd.c_str(), "r");
  std::string out;
  char buf[1024];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, n);
  const int status = ::pclose(pipe);
  EXPECT_EQ(WEXITSTATUS(status), 127) << out;
  EXPECT_NE(out.find("cannot run '/nonexistent/program'"), std::string::npos) << out;
  EXPECT_NE(out.find("rank 0 (pid"), std::string::npos) << out;
}
