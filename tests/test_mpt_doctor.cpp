// mpt-doctor end to end: its report on this machine (with or without a GPU),
// the problems it finds in a job's variables (missing, malformed, a busy
// MASTER_PORT, an unresolvable MASTER_ADDR, an unreachable rank 0, another
// program where rank 0's store should be, a store that refuses the job
// token), and the Gloo all-reduce check's sums. Also the NVML loader's
// answer here.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>

#include "parallel/tcp_store.h"
#include "tensor/error.h"
#include "diag/nvml.h"
#include "tests/test_util.h"

#ifndef MPT_DOCTOR_PATH
#error "MPT_DOCTOR_PATH must name the mpt-doctor binary"
#endif

namespace mpt {
namespace {

namespace fs = std::filesystem;

std::string mpt_doctor() { return testing::build_file("../tools/mpt-doctor/mpt-doctor", MPT_DOCTOR_PATH); }

// A socket listening on a port the kernel picked, on every interface (as
// another job's store would); closed with the object.
class Listener {
 public:
  Listener() {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    EXPECT_EQ(::listen(fd_, 4), 0);
    socklen_t len = sizeof addr;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
  }
  ~Listener() { close(); }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  int port() const { return port_; }
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// Another program on a port: it answers its first connection as a web
// server answers a request it cannot read, then closes.
class WebServer {
 public:
  WebServer() {
    thread_ = std::thread([this] {
      pollfd p{listener_.fd(), POLLIN, 0};
      if (::poll(&p, 1, 30000) != 1) return;  // mpt-doctor never came
      const int fd = ::accept(listener_.fd(), nullptr, nullptr);
      if (fd < 0) return;
      const std::string reply = "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
      (void)::send(fd, reply.data(), reply.size(), MSG_NOSIGNAL);
      ::shutdown(fd, SHUT_WR);
      char sink[256];
      while (::recv(fd, sink, sizeof sink, 0) > 0) {
      }
      ::close(fd);
    });
  }
  ~WebServer() { thread_.join(); }
  int port() const { return listener_.port(); }

 private:
  Listener listener_;
  std::thread thread_;
};

// Whether this machine has an NVIDIA GPU, as mpt-doctor tells it.
bool machine_has_gpu() {
  const nvml::Library* nvml = nvml::Library::try_get();
  return (nvml && nvml->device_count() > 0) || cuda_device_count() > 0;
}

class MptDoctor : public ::testing::Test {
 protected:
  // Runs mpt-doctor with exactly `variables` of the job's variables set
  // (the others removed from the environment); returns its exit status.
  int run(const std::string& variables, const std::string& args) {
    const std::string cmd = fmt::format(
        "env -u MASTER_ADDR -u MASTER_PORT -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u MPT_JOB_TOKEN "
        "{} '{}' {} >'{}' 2>'{}'",
        variables, mpt_doctor(), args, (dir_.path() / "out").string(), (dir_.path() / "err").string());
    const int rc = std::system(cmd.c_str());
    stdout_ = slurp(dir_.path() / "out");
    stderr_ = slurp(dir_.path() / "err");
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  }
  nlohmann::json run_json(const std::string& variables, const std::string& args = "") {
    rc_ = run(variables, "--json " + args);
    try {
      return nlohmann::json::parse(stdout_);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not JSON (" << e.what() << "): " << stdout_ << stderr_;
      return {};
    }
  }
  static std::string slurp(const fs::path& path) {
    std::ifstream in(path);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  }
  // The findings of one severity, as "text | fix" lines.
  static std::vector<std::string> findings(const nlohmann::json& report, const std::string& severity) {
    std::vector<std::string> out;
    for (const auto& f : report["findings"])
      if (f["severity"] == severity) {
        EXPECT_TRUE(f.contains("fix") && !f["fix"].get<std::string>().empty()) << f.dump();
        out.push_back(f["text"].get<std::string>() + " | " + f.value("fix", ""));
      }
    return out;
  }
  static bool any_contains(const std::vector<std::string>& lines, const std::string& part) {
    for (const auto& l : lines)
      if (l.find(part) != std::string::npos) return true;
    return false;
  }

  mpt::testing::TempDir dir_{"mpt-doctor-test"};
  std::string stdout_, stderr_;
  int rc_ = -1;
};

TEST_F(MptDoctor, ReportsThisMachineForPeople) {
  ASSERT_EQ(run("", ""), 0) << stdout_ << stderr_;
  testing::expect_contains(stdout_, {"Driver and libraries", "GPUs", "Distributed variables",
                                     "not started as a distributed job", "Rendezvous address and port"});
  if (!machine_has_gpu()) testing::expect_contains(stdout_, {"on this machine: training runs on the CPU"});
  if (!nvml::Library::try_get()) testing::expect_contains(stdout_, {"NVML not available: "});
  EXPECT_TRUE(stdout_.find("No problems found.") != std::string::npos ||
              stdout_.find("0 problems") != std::string::npos)
      << stdout_;
}

TEST_F(MptDoctor, ReportsThisMachineAsJson) {
  const nlohmann::json r = run_json("");
  ASSERT_EQ(rc_, 0) << stdout_ << stderr_;
  EXPECT_EQ(r["problems"], 0);
  EXPECT_EQ(r["gpus"]["count"].get<int>(), cuda_device_count());
  EXPECT_EQ(r["gpus"]["devices"].size(), static_cast<size_t>(cuda_device_count()));
  EXPECT_EQ(r["software"]["cuda_built"].get<bool>(), cuda_built());
  EXPECT_TRUE(r["environment"]["RANK"].is_null());
  EXPECT_EQ(r["network"]["port"], 29500);  // mpt-run's default, checked when MASTER_PORT is unset
  EXPECT_TRUE(r["network"].contains("port_free"));
}

TEST_F(MptDoctor, NamesMissingAndMalformedVariablesWithTheirFixes) {
  nlohmann::json r = run_json("RANK=1");
  EXPECT_EQ(rc_, 1) << stdout_;
  auto problems = findings(r, "problem");
  ASSERT_EQ(problems.size(), 1u) << r.dump(2);
  testing::expect_contains(problems[0], {"missing: MASTER_ADDR, MASTER_PORT, WORLD_SIZE", "export", "mpt-run"});

  r = run_json("MASTER_ADDR=127.0.0.1 MASTER_PORT=http RANK=x WORLD_SIZE=2 LOCAL_RANK=3 LOCAL_WORLD_SIZE=2");
  EXPECT_EQ(rc_, 1) << stdout_;
  problems = findings(r, "problem");
  EXPECT_TRUE(any_contains(problems, "RANK='x' is not a non-negative whole number")) << r.dump(2);
  EXPECT_TRUE(any_contains(problems, "MASTER_PORT='http' is not a port number")) << r.dump(2);
  EXPECT_TRUE(any_contains(problems, "LOCAL_RANK=3 is outside 0..1")) << r.dump(2);

  r = run_json("MASTER_ADDR=127.0.0.1 MASTER_PORT=1 RANK=2 WORLD_SIZE=2", "--connect-timeout-ms 200");
  EXPECT_TRUE(any_contains(findings(r, "problem"), "RANK=2 is outside 0..1 (WORLD_SIZE=2)")) << r.dump(2);
}

TEST_F(MptDoctor, FindsABusyMasterPortAndSuggestsAFreeOne) {
  Listener busy;
  const std::string vars = fmt::format("MASTER_ADDR=127.0.0.1 MASTER_PORT={} RANK=0 WORLD_SIZE=2", busy.port());
  nlohmann::json r = run_json(vars);
  EXPECT_EQ(rc_, 1) << stdout_;
  EXPECT_EQ(r["network"]["port_free"], false);
  const auto problems = findings(r, "problem");
  ASSERT_EQ(problems.size(), 1u) << r.dump(2);
  testing::expect_contains(problems[0], {fmt::format("MASTER_PORT {} is in use on this host", busy.port()),
                                         "export MASTER_PORT="});
  busy.close();
  r = run_json(vars);
  EXPECT_EQ(rc_, 0) << stdout_;
  EXPECT_EQ(r["network"]["port_free"], true);
  EXPECT_EQ(r["network"]["local"], true);
}

TEST_F(MptDoctor, FindsAnUnresolvableMasterAddr) {
  const nlohmann::json r = run_json("MASTER_ADDR=no-such-host.invalid MASTER_PORT=29511 RANK=1 WORLD_SIZE=2");
  EXPECT_EQ(rc_, 1) << stdout_;
  EXPECT_EQ(r["network"]["resolves"], false);
  EXPECT_TRUE(any_contains(findings(r, "problem"), "MASTER_ADDR 'no-such-host.invalid' does not resolve"))
      << r.dump(2);
}

// Ranks other than 0 greet rank 0's store as a rank does; rank 0 does not.
TEST_F(MptDoctor, ChecksThatRankZeroIsReachableFromOtherRanks) {
  auto store = std::make_unique<dist::TcpStore>("127.0.0.1", 0, true, std::chrono::milliseconds(5000));
  const int port = store->port();
  nlohmann::json r = run_json(fmt::format("MASTER_ADDR=127.0.0.1 MASTER_PORT={} RANK=1 WORLD_SIZE=2", port));
  EXPECT_EQ(rc_, 0) << stdout_;
  EXPECT_EQ(r["network"]["reachable"], true);
  EXPECT_EQ(r["network"]["answer"], "store");
  store.reset();
  r = run_json(fmt::format("MASTER_ADDR=127.0.0.1 MASTER_PORT={} RANK=1 WORLD_SIZE=2", port),
               "--connect-timeout-ms 300");
  EXPECT_EQ(rc_, 0) << stdout_;  // rank 0 may just not be up yet: a warning
  EXPECT_EQ(r["network"]["reachable"], false);
  EXPECT_TRUE(any_contains(findings(r, "warning"), fmt::format("127.0.0.1:{} within 300 ms", port))) << r.dump(2);
  r = run_json(fmt::format("MASTER_ADDR=127.0.0.1 MASTER_PORT={} RANK=0 WORLD_SIZE=2", port));
  EXPECT_TRUE(r["network"]["reachable"].is_null());
}

TEST_F(MptDoctor, GlooAllreduceSumsAreExact) {
  const nlohmann::json r = run_json("", "--comm --gloo-ranks 3 --sizes 4096 262144 --iterations 2");
  ASSERT_EQ(rc_, 0) << stdout_ << stderr_;
  const auto& gloo = r["comm_gloo"];
  if (gloo["results"].is_null()) GTEST_SKIP() << "skipped: this build has no Gloo";
  EXPECT_EQ(gloo["ranks"], 3);
  ASSERT_EQ(gloo["results"].size(), 2u);
  for (const auto& row : gloo["results"]) {
    EXPECT_EQ(row["sums_correct"], true) << row.dump();
    EXPECT_GT(row["time_us"].get<double>(), 0);
    // nccl-tests' definition for all-reduce: busbw = algbw * 2 (n - 1) / n.
    EXPECT_NEAR(row["busbw_gbps"].get<double>(), row["algbw_gbps"].get<double>() * 4.0 / 3.0, 1e-9);
  }
  EXPECT_EQ(gloo["results"][1]["bytes"], 262144);
  if (!testing::has_cuda() && machine_has_gpu()) EXPECT_TRUE(r["comm_nccl"]["results"].is_null());
}

// Another program where rank 0's store should be is a problem, found here
// rather than by the job: one that answers like a web server, and one that
// accepts connections and says nothing (a socket nobody serves).
TEST_F(MptDoctor, FindsAProgramThatIsNotRankZerosStore) {
  WebServer web;
  nlohmann::json r =
      run_json(fmt::format("MASTER_ADDR=127.0.0.1 MASTER_PORT={} RANK=1 WORLD_SIZE=2", web.port()));
  EXPECT_EQ(rc_, 1) << stdout_;
  EXPECT_EQ(r["network"]["answer"], "not_a_store");
  auto problems = findings(r, "problem");
  ASSERT_EQ(problems.size(), 1u) << r.dump(2);
  testing::expect_contains(problems[0],
                           {fmt::format("the service at 127.0.0.1:{} is not an mptrain store", web.port()),
                            "(it answered 'HTTP/1.1 400 Bad Request')", "MASTER_PORT nothing else uses"});

  Listener silent;  // listens, never accepts: the kernel completes the connection
  const std::string vars = fmt::format("MASTER_ADDR=127.0.0.1 MASTER_PORT={} RANK=1 WORLD_SIZE=2", silent.port());
  EXPECT_EQ(run(vars, "--connect-timeout-ms 300"), 1) << stdout_;
  testing::expect_contains(stdout_, {"PROBLEM ", fmt::format("127.0.0.1:{} accepted the connection", silent.port()),
                                     "did not answer the store's greeting within 300 ms", "1 problem"});
  EXPECT_EQ(stdout_.find("No problems found"), std::string::npos) << stdout_;
}

// A store of another job (or a rank given another token) is named as such;
// without a token here it may be the launcher's, so only a warning. The
// store serves on, its own members unharmed.
TEST_F(MptDoctor, NamesAStoreThatRefusesThisJobToken) {
  dist::TcpStore store("127.0.0.1", 0, true, std::chrono::milliseconds(5000), {.job_token = "job-A"});
  const std::string vars = fmt::format("MASTER_ADDR=127.0.0.1 MASTER_PORT={} RANK=1 WORLD_SIZE=2", store.port());
  nlohmann::json r = run_json("MPT_JOB_TOKEN=job-B " + vars);
  EXPECT_EQ(rc_, 1) << stdout_;
  EXPECT_EQ(r["network"]["answer"], "refused");
  const auto problems = findings(r, "problem");
  ASSERT_EQ(problems.size(), 1u) << r.dump(2);
  testing::expect_contains(problems[0], {"refused this process", "job token", "same MPT_JOB_TOKEN"});

  r = run_json(vars);
  EXPECT_EQ(rc_, 0) << stdout_;
  EXPECT_TRUE(any_contains(findings(r, "warning"), "MPT_JOB_TOKEN is not set here")) << r.dump(2);

  r = run_json("MPT_JOB_TOKEN=job-A " + vars);
  EXPECT_EQ(rc_, 0) << stdout_;
  EXPECT_EQ(r["network"]["answer"], "store");
  store.set("still", std::string("serving"));
  EXPECT_EQ(store.get_string("still"), "serving");
}

// On a machine without an NVIDIA driver or GPU the report says so in those
// words (not as cudaGetDeviceCount's "driver version is insufficient") and
// leaves out what only applies to GPUs.
TEST_F(MptDoctor, SaysPlainlyThatThisMachineHasNoGpu) {
  if (machine_has_gpu()) GTEST_SKIP() << "skipped: this machine has a GPU";
  ASSERT_EQ(run("", "--comm --gloo-ranks 2 --sizes 4096 --iterations 1"), 0) << stdout_ << stderr_;
  testing::expect_contains(stdout_, {nvml::Library::try_get()
                                         ? "no NVIDIA GPU on this machine (driver "
                                         : "no NVIDIA driver or GPU on this machine: training runs on the CPU"});
  for (const char* absent : {"cudaErrorInsufficientDriver", "driver version is insufficient", "CUDA_VISIBLE_DEVICES",
                             "NCCL_", "local GPU", "(NCCL)"})
    EXPECT_EQ(stdout_.find(absent), std::string::npos) << "'" << absent << "' in:\n" << stdout_;
  const nlohmann::json r = run_json("", "--comm --gloo-ranks 2 --sizes 4096 --iterations 1");
  EXPECT_EQ(r["gpus"]["machine_has_gpu"], false);
  EXPECT_FALSE(r.contains("comm_nccl"));
  EXPECT_FALSE(r["environment"].contains("NCCL"));
}

TEST(Nvml, LoadsAtRunTimeOrSaysWhyNot) {
  std::string why;
  const nvml::Library* nvml = nvml::Library::try_get(&why);
  if (nvml) {
    EXPECT_GE(nvml->device_count(), cuda_device_count());
    EXPECT_FALSE(nvml->driver_version().empty());
    return;
  }
  EXPECT_NE(why.find("libnvidia-ml.so.1"), std::string::npos) << why;
  const std::string message = testing::error_of<NotAvailableError>([] { nvml::Library::get(); });
  EXPECT_EQ(message.rfind("NVML not available: ", 0), 0u) << message;
}

}  // namespace
}  // namespace mpt
