// Two hosts (network namespaces joined by a veth pair), one mpt-run in
// each with --nnodes 2: DDP over Gloo across them equals one process, and
// cutting the wire mid-run ends both sides within the collectives' timeout,
// each naming the peer it lost. Skips, saying why, where namespaces cannot
// be made (not root).
#include <chrono>
#include <memory>
#include <sstream>
#include <string>
#include <utility>

#include "parallel/child_process.h"
#include "parallel/launch.h"
#include "parallel/netns_hosts.h"
#include "test_util.h"

using mpt::testing::ChildProcess;
using mpt::testing::NetnsHosts;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kTimeoutS = 10;  // the collectives' timeout in the link test

std::string log_file(const std::string& name) { return fmt::format("/tmp/mpt-two-hosts-{}-{}.log", ::getpid(), name); }

// mpt-run on `host`, node `host` of 2, rank 0's store on host 0; Gloo told
// which interface to use (GLOO_SOCKET_IFNAME), or left to find it.
std::unique_ptr<ChildProcess> launcher(const NetnsHosts& hosts, int host, const std::string& mode, int port,
                                       const std::string& log, bool name_interface = true) {
  std::map<std::string, std::string> env{{"MPT_TEST_TIMEOUT_S", std::to_string(kTimeoutS)}};
  // Gloo: reach the peer over the veth, not this host's name.
  if (name_interface) env["GLOO_SOCKET_IFNAME"] = hosts.interface(host);
  return std::make_unique<ChildProcess>(
      std::vector<std::string>{"ip", "netns", "exec", hosts.name(host), mpt::testing::mpt_run_path(), "--nnodes", "2",
                               "--node_rank", std::to_string(host), "--nproc_per_node", "1", "--master_addr",
                               NetnsHosts::address(0), "--master_port", std::to_string(port), "--job_token",
                               "two-hosts-test", "--kill_timeout", "2", mpt::testing::ddp_worker_path(), mode},
      env, log);
}

// Shows the lines of `out` that hold `text` (the figures the test checked).
void show_lines_with(const std::string& out, const std::string& text) {
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);)
    if (line.find(text) != std::string::npos) std::printf("%s\n", line.c_str());
}

}  // namespace

// Both hosts run ddp_worker's plain training (each rank compares its
// parameters with one process) to the end; both must exit 0. Returns the
// hosts' outputs.
std::pair<std::string, std::string> train_plainly_on_two_hosts(const NetnsHosts& hosts, const std::string& name,
                                                               bool name_interface) {
  const int port = 29500;  // each host has its own ports
  auto node0 = launcher(hosts, 0, "plain", port, log_file(name + "0"), name_interface);
  auto node1 = launcher(hosts, 1, "plain", port, log_file(name + "1"), name_interface);
  const auto s1 = node1->wait(120), s0 = node0->wait(120);
  const std::string out0 = node0->output(), out1 = node1->output();
  std::remove(log_file(name + "0").c_str());
  std::remove(log_file(name + "1").c_str());
  EXPECT_TRUE(s0 && s1) << out0 << out1;
  if (s0) EXPECT_EQ(WEXITSTATUS(*s0), 0) << out0;
  if (s1) EXPECT_EQ(WEXITSTATUS(*s1), 0) << out1;
  EXPECT_NE(out0.find("[rank 0] rank 0: "), std::string::npos) << out0;
  EXPECT_NE(out1.find("[rank 1] rank 1: "), std::string::npos) << out1;
  EXPECT_NE(out1.find("max relative parameter error"), std::string::npos) << out1;
  return {out0, out1};
}

TEST(TwoHosts, DdpAcrossTwoHostsMatchesOneProcess) {
  NetnsHosts hosts;
  if (!hosts.error().empty()) GTEST_SKIP() << "skipped: cannot make two hosts: " << hosts.error();
  const auto [out0, out1] = train_plainly_on_two_hosts(hosts, "plain", /*name_interface=*/true);
  show_lines_with(out0 + out1, "max relative parameter error");
}

// Without GLOO_SOCKET_IFNAME each rank offers Gloo the address its store
// connection leaves from (rank 0: the address the others reached its store
// at). This host's name would not do: it resolves to a loopback address
// (127.0.1.1 on Debian), where no other host can reach it.
TEST(TwoHosts, WithoutAnInterfaceNamedGlooTakesTheRouteToTheMaster) {
  NetnsHosts hosts;
  if (!hosts.error().empty()) GTEST_SKIP() << "skipped: cannot make two hosts: " << hosts.error();
  train_plainly_on_two_hosts(hosts, "route", /*name_interface=*/false);
}

TEST(TwoHosts, CuttingTheLinkEndsBothSidesNamingThePeer) {
  NetnsHosts hosts;
  if (!hosts.error().empty()) GTEST_SKIP() << "skipped: cannot make two hosts: " << hosts.error();
  const int port = 29500;
  auto node0 = launcher(hosts, 0, "train", port, log_file("cut0"));
  auto node1 = launcher(hosts, 1, "train", port, log_file("cut1"));
  ASSERT_TRUE(node0->wait_for_output("[rank 0] rank 0: step 30", 60)) << node0->output() << node1->output();
  ASSERT_TRUE(node1->wait_for_output("[rank 1] rank 1: step 30", 60)) << node1->output();
  ASSERT_TRUE(hosts.cut_link());
  const auto cut_at = Clock::now();
  const auto s0 = node0->wait(kTimeoutS + 10);
  const auto s1 = node1->wait(kTimeoutS + 10 - std::chrono::duration<double>(Clock::now() - cut_at).count());
  const double took = std::chrono::duration<double>(Clock::now() - cut_at).count();
  const std::string out0 = node0->output(), out1 = node1->output();
  std::remove(log_file("cut0").c_str());
  std::remove(log_file("cut1").c_str());
  ASSERT_TRUE(s0 && s1) << "still running " << took << " s after the cut:\n" << out0 << out1;
  EXPECT_NE(WEXITSTATUS(*s0), 0) << out0;
  EXPECT_NE(WEXITSTATUS(*s1), 0) << out1;
  // The step in flight when the wire went waits one timeout, then at most
  // 2 s more asking the store who left.
  EXPECT_LT(took, kTimeoutS + 5) << out0 << out1;
  EXPECT_NE(out0.find("no answer from rank 1"), std::string::npos) << out0;
  EXPECT_NE(out1.find("no answer from rank 0"), std::string::npos) << out1;
  EXPECT_NE(out0.find("mpt-run: rank 0 (pid"), std::string::npos) << out0;
  EXPECT_NE(out1.find("mpt-run: rank 1 (pid"), std::string::npos) << out1;
  show_lines_with(out0 + out1, "error: ");
  std::printf("faults injected: 1 cut link, survived: %d (both sides ended %.2f s after the cut, timeout %d s)\n",
              s0 && s1 && *s0 != 0 && *s1 != 0 ? 1 : 0, took, kTimeoutS);
}
