// mpt-run end to end: two ranks on Gloo train with DDP and match one
// process on the concatenated batch; a failing rank brings the job down
// quickly, named, with no process left behind.
#include <signal.h>

#include <fstream>
#include <regex>
#include <string>
#include <thread>

#include "parallel/launch.h"
#include "test_util.h"

using mpt::testing::JobResult;
using mpt::testing::run_job;

TEST(Launcher, DdpPlainStepsMatchOneProcess) {
  const JobResult r = run_job("plain");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 0] rank 0: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 1] rank 1: "), std::string::npos) << r.output;
}

TEST(Launcher, DdpNoSyncAccumulationMatchesOneProcess) {
  const JobResult r = run_job("accum");
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

// Close to one process, yet visibly rounded: the worker fails when the
// averaged gradients are not bf16 values or the error is no larger than
// f32 transit's.
TEST(Launcher, DdpWithBf16CompressionStaysCloseAndRounds) {
  const JobResult r = run_job("compress");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("least 1e-05"), std::string::npos) << r.output;
}

TEST(Launcher, DdpUnusedParametersAreReportedOrDetected) {
  const JobResult r = run_job("unused");
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

TEST(Launcher, ThreeRanksAlsoMatch) {
  const JobResult r = run_job("plain", 3);
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

// The scale of the multi-GPU machines (4 and 8 ranks), on Gloo: every rank
// ends with the parameters of one process on the concatenated batch.
TEST(Launcher, FourRanksWithAccumulationMatch) {
  const JobResult r = run_job("accum", 4);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 3] rank 3: "), std::string::npos) << r.output;
}

TEST(Launcher, EightRanksMatch) {
  const JobResult r = run_job("plain", 8);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 7] rank 7: "), std::string::npos) << r.output;
}

TEST(Launcher, AFailingRankStopsTheJobNamingIt) {
  const JobResult r = run_job("die");
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
  const JobResult r = mpt::testing::run_shell(fmt::format("'{}' --nproc_per_node 1 --master_port {} /nonexistent/program",
                                                          mpt::testing::mpt_run_path(), mpt::testing::free_port()));
  EXPECT_EQ(r.exit_code, 127) << r.output;
  EXPECT_NE(r.output.find("cannot run '/nonexistent/program'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 0 (pid"), std::string::npos) << r.output;
}

TEST(Launcher, TheProcessCountIsRequired) {
  const JobResult r = mpt::testing::run_shell(fmt::format("'{}' /bin/true", mpt::testing::mpt_run_path()));
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("--nproc_per_node"), std::string::npos) << r.output;
}

// A rank that crashes and one that exits with an error a moment later (as
// a survivor of the broken connection would): mpt-run names the crash,
// even when it sees both ends at one look. (The crashed rank leaves a child
// holding its output open, as a rank's helper processes may, so its death
// closes no pipe that would wake mpt-run before the second rank ends.)
TEST(Launcher, ACrashIsNamedBeforeTheErrorsItCaused) {
  const std::string flag = fmt::format("/tmp/mpt-launcher-crash-{}", ::getpid());
  std::remove(flag.c_str());
  // Rank 2 leaves its pid in the flag file and crashes; rank 1 waits until
  // rank 2 is dead (a zombie, or already reaped), then exits with status 1.
  const std::string program = fmt::format(
      "if [ $RANK = 2 ]; then sleep 30 & echo $$ > {0}.new; mv {0}.new {0}; kill -SEGV $$; fi; "
      "if [ $RANK = 1 ]; then while [ ! -e {0} ]; do sleep 0.001; done; p=$(cat {0}); "
      "while [ -e /proc/$p ] && [ \"$(cut -d\" \" -f3 /proc/$p/stat)\" != Z ]; do sleep 0.001; done; exit 1; fi; "
      "sleep 30",
      flag);
  for (int round = 0; round < 3; ++round) {
    std::remove(flag.c_str());
    const JobResult r = mpt::testing::run_shell(fmt::format("'{}' --nproc_per_node 3 --master_port {} sh -c '{}'",
                                                            mpt::testing::mpt_run_path(), mpt::testing::free_port(),
                                                            program));
    EXPECT_EQ(r.exit_code, 128 + SIGSEGV) << r.output;
    EXPECT_NE(r.output.find("rank 2 (pid"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("failed with signal 11"), std::string::npos) << r.output;
  }
  std::remove(flag.c_str());
  std::remove((flag + ".new").c_str());
}

// An option mpt-run does not know is refused, not run as the program; the
// spellings torchrun also accepts (--nproc-per-node, --master-port, ...)
// are mpt-run's own.
TEST(Launcher, UnknownOptionsAreRefusedAndTorchrunsSpellingsAccepted) {
  const JobResult unknown = mpt::testing::run_shell(
      fmt::format("'{}' --nproc_per_node 1 --standalone /bin/true", mpt::testing::mpt_run_path()));
  EXPECT_EQ(unknown.exit_code, 2) << unknown.output;
  EXPECT_NE(unknown.output.find("unknown option '--standalone'"), std::string::npos) << unknown.output;
  const int port = mpt::testing::free_port();
  const JobResult hyphens = mpt::testing::run_shell(
      fmt::format("'{}' --nproc-per-node 2 --master-port {} --kill-timeout 1 sh -c 'echo rank=$RANK port=$MASTER_PORT'",
                  mpt::testing::mpt_run_path(), port));
  EXPECT_EQ(hyphens.exit_code, 0) << hyphens.output;
  EXPECT_NE(hyphens.output.find(fmt::format("rank=1 port={}", port)), std::string::npos) << hyphens.output;
}

// Started under nohup (SIGHUP ignored), a hang-up leaves the job running.
TEST(Launcher, AHangupIgnoredAtTheStartIsLeftIgnored) {
  const JobResult r = mpt::testing::run_shell(fmt::format(
      "trap '' HUP; '{}' --nproc_per_node 1 --master_port {} sh -c 'sleep 1; echo survived' & pid=$!; "
      "sleep 0.3; kill -HUP $pid; wait $pid; echo status=$?",
      mpt::testing::mpt_run_path(), mpt::testing::free_port()));
  EXPECT_NE(r.output.find("survived"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("status=0"), std::string::npos) << r.output;
}

// Ranks read no terminal input (a rank in a process group of its own that
// read the terminal would be stopped, and the job would hang): their input
// is empty, whatever the launcher's is.
TEST(Launcher, RanksReadNoInput) {
  const JobResult r = mpt::testing::run_shell(
      fmt::format("timeout 20 '{}' --nproc_per_node 1 --master_port {} sh -c 'read x; echo read=$?' < /dev/zero",
                  mpt::testing::mpt_run_path(), mpt::testing::free_port()));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("read=1"), std::string::npos) << r.output;
}

// Several nodes need the master's address: the default, 127.0.0.1, would
// leave the other nodes waiting out their timeout for a store they cannot reach.
TEST(Launcher, SeveralNodesNeedTheMastersAddress) {
  const JobResult r = mpt::testing::run_shell(
      fmt::format("'{}' --nnodes 2 --node_rank 1 --nproc_per_node 1 /bin/true", mpt::testing::mpt_run_path()));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--nnodes 2 needs --master_addr"), std::string::npos) << r.output;
}

// Started with SIGCHLD ignored (as some parents leave it), mpt-run still
// sees its ranks end and reports their status.
TEST(Launcher, AnIgnoredSigchldIsNoHang) {
  const JobResult r = mpt::testing::run_shell(fmt::format(
      "trap '' CHLD; timeout 20 '{}' --nproc_per_node 2 --master_port {} sh -c 'exit 3'; echo status=$?",
      mpt::testing::mpt_run_path(), mpt::testing::free_port()));
  EXPECT_NE(r.output.find("status=3"), std::string::npos) << r.output;
}

// Each rank's CPU backend gets its share of the launcher's CPUs, unless
// MPT_CPU_THREADS says otherwise.
TEST(Launcher, RanksShareTheCpus) {
  if (std::thread::hardware_concurrency() < 2 || mpt::testing::run_shell("taskset -c 0-1 true").exit_code != 0)
    GTEST_SKIP() << "skipped: needs 2 CPUs and taskset";
  const auto job = [](const std::string& env, int nproc) {
    const JobResult r = mpt::testing::run_shell(
        fmt::format("{} taskset -c 0-1 '{}' --nproc_per_node {} --master_port {} sh -c 'echo threads=$MPT_CPU_THREADS'",
                    env, mpt::testing::mpt_run_path(), nproc, mpt::testing::free_port()));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return r.output;
  };
  const std::string alone = job("env -u MPT_CPU_THREADS", 1);
  EXPECT_NE(alone.find("[rank 0] threads=2"), std::string::npos) << alone;
  const std::string two = job("env -u MPT_CPU_THREADS", 2);
  EXPECT_NE(two.find("[rank 0] threads=1"), std::string::npos) << two;
  EXPECT_NE(two.find("[rank 1] threads=1"), std::string::npos) << two;
  const std::string given = job("MPT_CPU_THREADS=3", 2);
  EXPECT_NE(given.find("[rank 1] threads=3"), std::string::npos) << given;
}

TEST(Launcher, TwoNodesOnOneHostFormOneWorld) {
  // Two launchers, as on two machines: --nnodes 2, one process each.
  const int port = mpt::testing::free_port();
  auto node = [&](int node_rank) {
    return fmt::format("('{}' --nnodes 2 --node_rank {} --nproc_per_node 1 --master_addr 127.0.0.1 --master_port {} "
                       "'{}' plain; echo node{}=$?)",
                       mpt::testing::mpt_run_path(), node_rank, port, mpt::testing::ddp_worker_path(), node_rank);
  };
  const JobResult r = mpt::testing::run_shell(fmt::format("sh -c \"{} & {}; wait\"", node(0), node(1)));
  EXPECT_NE(r.output.find("node0=0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("node1=0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 1] rank 1 of 2 ready"), std::string::npos) << r.output;
}

// A rank that prints without pause (faster than mpt-run re-emits its
// lines) must not keep mpt-run from seeing the other rank fail.
TEST(Launcher, ARankThatNeverStopsPrintingDoesNotHideAFailure) {
  const JobResult r = mpt::testing::run_shell(fmt::format(
      "'{}' --nproc_per_node 2 --master_port {} --kill_timeout 2 sh -c "
      "'if [ $RANK = 0 ]; then exec yes; else sleep 1; exit 3; fi' >/dev/null 2>/tmp/mpt-run-yes-{}.err; "
      "echo status=$?; cat /tmp/mpt-run-yes-{}.err; rm -f /tmp/mpt-run-yes-{}.err",
      mpt::testing::mpt_run_path(), mpt::testing::free_port(), ::getpid(), ::getpid(), ::getpid()));
  EXPECT_NE(r.output.find("status=3"), std::string::npos) << r.output.substr(0, 2000);
  EXPECT_NE(r.output.find("rank 1 (pid"), std::string::npos) << r.output.substr(0, 2000);
  EXPECT_LT(r.seconds, 15.0);
}

TEST(Launcher, StoppingTheLauncherStopsEveryRank) {
  const std::string log = fmt::format("/tmp/mpt-run-stop-{}.log", ::getpid());
  const JobResult r = mpt::testing::run_shell(fmt::format(
      "'{}' --nproc_per_node 2 --master_port {} --kill_timeout 2 '{}' sleep >{} 2>&1 & pid=$!; "
      "sleep 2; kill -TERM $pid; wait $pid; echo status=$?",
      mpt::testing::mpt_run_path(), mpt::testing::free_port(), mpt::testing::ddp_worker_path(), log));
  EXPECT_NE(r.output.find("status=143"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 15.0);
  std::ifstream in(log);
  const std::string out((std::istreambuf_iterator<char>(in)), {});
  std::remove(log.c_str());
  EXPECT_NE(out.find("mpt-run received signal 15"), std::string::npos) << out;
  const std::regex ready(R"(rank (\d) of 2 ready, pid (\d+))");
  int seen = 0;
  for (auto it = std::sregex_iterator(out.begin(), out.end(), ready); it != std::sregex_iterator(); ++it, ++seen)
    EXPECT_NE(::kill(std::stoi((*it)[2]), 0), 0) << "rank " << (*it)[1] << " outlived the launcher";
  EXPECT_EQ(seen, 2) << out;
}

namespace {
// Whether `pid` runs: a zombie no one reaped yet counts as gone.
bool process_alive(pid_t pid) {
  std::ifstream stat(fmt::format("/proc/{}/stat", pid));
  std::string line;
  if (!std::getline(stat, line)) return false;
  const size_t state = line.rfind(')') + 2;  // after the command name, which may hold spaces
  return state < line.size() && line[state] != 'Z';
}
}  // namespace

// A launcher killed outright (SIGKILL: no handler of its own runs) takes
// down what its ranks started too, not only the ranks.
TEST(Launcher, AKilledLauncherLeavesNoGrandchildren) {
  const std::string pids = fmt::format("/tmp/mpt-run-orphans-{}", ::getpid());
  const JobResult r = mpt::testing::run_shell(fmt::format(
      "'{}' --nproc_per_node 2 --master_port {} sh -c 'sleep 60 & echo $! > {}.$RANK; wait' & pid=$!; "
      "for i in $(seq 100); do [ -s {}.0 ] && [ -s {}.1 ] && break; sleep 0.1; done; "
      "kill -KILL $pid; wait $pid; echo status=$?",
      mpt::testing::mpt_run_path(), mpt::testing::free_port(), pids, pids, pids));
  EXPECT_NE(r.output.find("status=137"), std::string::npos) << r.output;
  for (int rank = 0; rank < 2; ++rank) {
    std::ifstream in(fmt::format("{}.{}", pids, rank));
    pid_t grandchild = 0;
    ASSERT_TRUE(in >> grandchild) << "rank " << rank << " did not start its child: " << r.output;
    std::remove(fmt::format("{}.{}", pids, rank).c_str());
    bool alive = true;
    for (int i = 0; i < 100 && alive; ++i) {
      alive = process_alive(grandchild);
      if (alive) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    EXPECT_FALSE(alive) << "rank " << rank << "'s child " << grandchild << " outlived the killed launcher";
    if (alive) ::kill(grandchild, SIGKILL);
  }
}

