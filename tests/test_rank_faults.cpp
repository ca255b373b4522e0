// A rank killed (SIGKILL) in the middle of DDP training: every other rank
// ends within the collectives' timeout with an error naming the rank that
// went away, the launcher names it too, and no process is left behind.
// Each test counts the kills it injected; all of them must be survived.
#include <signal.h>

#include <chrono>
#include <regex>
#include <string>

#include "parallel/child_process.h"
#include "parallel/launch.h"
#include "test_util.h"

using mpt::testing::ChildProcess;
using mpt::testing::ddp_worker_path;
using mpt::testing::free_port;
using mpt::testing::mpt_run_path;
using Clock = std::chrono::steady_clock;

namespace {

// The collectives' timeout the ranks run with. A dead process closes its
// connections at once, so survivors usually end within a second; the
// bound is the timeout plus the few seconds a survivor may spend asking
// the store who left (Gloo now and then notices a closed connection only
// at the timeout).
constexpr int kTimeoutS = 20, kBoundS = kTimeoutS + 5;

std::string log_file(const std::string& name) {
  return fmt::format("/tmp/mpt-rank-faults-{}-{}.log", ::getpid(), name);
}

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

bool alive(pid_t pid) { return ::kill(pid, 0) == 0; }

// The pid a rank printed when it was ready ("rank R of W ready, pid P").
pid_t ready_pid(const std::string& output, int rank) {
  std::smatch m;
  const std::regex ready(fmt::format(R"(rank {} of \d+ ready, pid (\d+))", rank));
  return std::regex_search(output, m, ready) ? std::stoi(m[1]) : -1;
}

// `world` ranks of ddp_worker's training started directly (no launcher),
// with collectives that time out after `timeout_s`; logs named by `name`.
std::vector<std::unique_ptr<ChildProcess>> start_ranks(int world, int timeout_s, const std::string& name) {
  return mpt::testing::start_worker_ranks(world, {"train"}, timeout_s, {},
                                          [&](int r) { return log_file(fmt::format("{}-{}", name, r)); });
}

}  // namespace

// Ranks started directly, as on separate machines with nobody to stop
// them: each survivor must notice the death by itself.
TEST(RankFaults, EverySurvivorNamesTheKilledRank) {
  const int world = 3;
  int injected = 0, survived = 0;
  for (int victim : {1, 2, 0}) {
    SCOPED_TRACE(fmt::format("killed rank {}", victim));
    const auto ranks = start_ranks(world, kTimeoutS, fmt::format("direct{}", victim));
    ASSERT_TRUE(ranks[victim]->wait_for_output(fmt::format("rank {}: step 30", victim), 60))
        << ranks[victim]->output();
    ranks[victim]->signal(SIGKILL);
    const auto killed_at = Clock::now();
    ++injected;
    ASSERT_TRUE(ranks[victim]->wait(5));

    bool all_ok = true;
    for (int r = 0; r < world; ++r) {
      if (r == victim) continue;
      const auto status = ranks[r]->wait(kBoundS - seconds_since(killed_at));
      const double took = seconds_since(killed_at);
      const std::string out = ranks[r]->output();
      ASSERT_TRUE(status.has_value()) << "rank " << r << " still runs " << took << " s after the kill:\n" << out;
      EXPECT_TRUE(mpt::testing::exited_with_failure(*status)) << out;
      EXPECT_LT(took, kBoundS) << out;
      // Rank 0 hosts the store: when it dies, the store goes with it.
      const std::string named = victim == 0 ? "rank 0, its host, left the job"
                                            : fmt::format("rank {} left the job first", victim);
      EXPECT_NE(out.find(named), std::string::npos) << "rank " << r << " does not say '" << named << "':\n" << out;
      all_ok = all_ok && status && mpt::testing::exited_with_failure(*status) && out.find(named) != std::string::npos;
      std::printf("killed rank %d: rank %d ended %.2f s later\n", victim, r, took);
    }
    survived += all_ok;
    for (int r = 0; r < world; ++r) std::remove(log_file(fmt::format("direct{}-{}", victim, r)).c_str());
  }
  std::printf("faults injected: %d, survived: %d\n", injected, survived);
  EXPECT_EQ(survived, injected);
}

// A rank that stalls (SIGSTOP: alive, its connections open, silent): the
// others time out at about the same moment, and whichever exits first must
// not be named by the rest as the rank that left first; the store host
// stays long enough for them to ask it.
TEST(RankFaults, SurvivorsOfAStalledRankBlameNoSurvivor) {
  const int world = 3, stalled = 1, timeout_s = 4;
  const auto ranks = start_ranks(world, timeout_s, "stalled");
  ASSERT_TRUE(ranks[stalled]->wait_for_output(fmt::format("rank {}: step 30", stalled), 60))
      << ranks[stalled]->output();
  ranks[stalled]->signal(SIGSTOP);
  const auto stopped_at = Clock::now();
  for (int r : {0, 2}) {
    const auto status = ranks[r]->wait(timeout_s + 15 - seconds_since(stopped_at));
    const std::string out = ranks[r]->output();
    ASSERT_TRUE(status.has_value()) << "rank " << r << " still runs:\n" << out;
    EXPECT_TRUE(mpt::testing::exited_with_failure(*status)) << out;
    EXPECT_NE(out.find("no answer from ranks"), std::string::npos) << out;
    for (const char* blame : {"rank 0 left the job first", "rank 2 left the job first", "rank 0, its host, left"})
      EXPECT_EQ(out.find(blame), std::string::npos) << "rank " << r << " blames a survivor ('" << blame << "'):\n"
                                                      << out;
    std::printf("stalled rank %d: rank %d ended %.2f s later\n", stalled, r, seconds_since(stopped_at));
  }
  ranks[stalled]->signal(SIGKILL);
  ASSERT_TRUE(ranks[stalled]->wait(5));
  for (int r = 0; r < world; ++r) std::remove(log_file(fmt::format("stalled-{}", r)).c_str());
}

// Under mpt-run: the launcher sees the death first, names the rank and
// its signal, and stops the other ranks; none outlives it.
TEST(RankFaults, TheLauncherNamesAKilledRankAndLeavesNoProcess) {
  ChildProcess run({mpt_run_path(), "--nproc_per_node", "3", "--master_port", std::to_string(free_port()),
                    "--kill_timeout", "2", ddp_worker_path(), "train"},
                   {{"MPT_TEST_TIMEOUT_S", std::to_string(kTimeoutS)}}, log_file("launcher"));
  ASSERT_TRUE(run.wait_for_output("[rank 1] rank 1: step 30", 60)) << run.output();
  // Every rank's pid, known before the kill: without one, the check that
  // no rank outlived mpt-run would pass for want of a process to look at.
  std::vector<pid_t> pids;
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(run.wait_for_output(fmt::format("rank {} of 3 ready, pid", r), 10)) << run.output();
    pids.push_back(ready_pid(run.output(), r));
    ASSERT_GT(pids.back(), 0) << "rank " << r << ":\n" << run.output();
  }
  ::kill(pids[1], SIGKILL);
  const auto killed_at = Clock::now();
  const auto status = run.wait(kBoundS);
  const double took = seconds_since(killed_at);
  const std::string out = run.output();
  std::remove(log_file("launcher").c_str());
  ASSERT_TRUE(status.has_value()) << out;
  EXPECT_EQ(WEXITSTATUS(*status), 128 + SIGKILL) << out;
  EXPECT_NE(out.find(fmt::format("rank 1 (pid {}) failed with signal 9", pids[1])), std::string::npos) << out;
  EXPECT_LT(took, kBoundS);
  for (int r = 0; r < 3; ++r) EXPECT_FALSE(alive(pids[r])) << "rank " << r << " outlived mpt-run";
  std::printf("faults injected: 1, survived: %d (mpt-run ended %.2f s after the kill)\n",
              status && !alive(pids[0]) && !alive(pids[2]) ? 1 : 0, took);
}

// Two launchers, as on two machines: the one whose rank was killed reports
// it; on the other, the rank finds its peer gone, names it, and fails, and
// its launcher reports that.
TEST(RankFaults, TwoLaunchersBothEndWhenARankOfOneIsKilled) {
  const std::string port = std::to_string(free_port());
  auto node = [&](int node_rank) {
    return std::make_unique<ChildProcess>(
        std::vector<std::string>{mpt_run_path(), "--nnodes", "2", "--node_rank", std::to_string(node_rank),
                                 "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port,
                                 "--job_token", "faults-test",
                                 ddp_worker_path(), "train"},
        std::map<std::string, std::string>{{"MPT_TEST_TIMEOUT_S", std::to_string(kTimeoutS)}},
        log_file(fmt::format("node{}", node_rank)));
  };
  auto node0 = node(0), node1 = node(1);
  ASSERT_TRUE(node1->wait_for_output("[rank 1] rank 1: step 30", 60)) << node1->output();
  const pid_t victim = ready_pid(node1->output(), 1);
  ASSERT_GT(victim, 0) << node1->output();
  // The survivor's pid, known before the kill (else the check that it
  // ended would pass for want of a process to look at).
  ASSERT_TRUE(node0->wait_for_output("rank 0 of 2 ready, pid", 10)) << node0->output();
  const pid_t survivor = ready_pid(node0->output(), 0);
  ASSERT_GT(survivor, 0) << node0->output();
  ::kill(victim, SIGKILL);
  const auto killed_at = Clock::now();
  const auto s1 = node1->wait(kBoundS);
  const auto s0 = node0->wait(kBoundS - seconds_since(killed_at));
  const double took = seconds_since(killed_at);
  const std::string out0 = node0->output(), out1 = node1->output();
  std::remove(log_file("node0").c_str());
  std::remove(log_file("node1").c_str());
  ASSERT_TRUE(s0.has_value() && s1.has_value()) << out0 << out1;
  EXPECT_EQ(WEXITSTATUS(*s1), 128 + SIGKILL) << out1;
  EXPECT_NE(out1.find("rank 1 (pid"), std::string::npos) << out1;
  EXPECT_NE(WEXITSTATUS(*s0), 0) << out0;
  EXPECT_NE(out0.find("[rank 0] error: "), std::string::npos) << out0;
  EXPECT_NE(out0.find("rank 1 left the job first"), std::string::npos) << out0;
  EXPECT_NE(out0.find("mpt-run: rank 0 (pid"), std::string::npos) << out0;
  EXPECT_LT(took, kBoundS);
  EXPECT_FALSE(alive(survivor)) << "rank 0 outlived its launcher";
  std::printf("faults injected: 1, survived: %d (both launchers ended %.2f s after the kill)\n",
              s0 && s1 && out0.find("rank 1 left the job first") != std::string::npos ? 1 : 0, took);
}
