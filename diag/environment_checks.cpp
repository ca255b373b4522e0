// The job's environment: the variables a launcher sets, and whether the
// rendezvous address and port they name can work from here.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>

#include <fmt/format.h>

#include "parallel/distributed_error.h"
#include "parallel/rendezvous.h"
#include "parallel/socket_util.h"
#include "parallel/tcp_store.h"
#include "tensor/device.h"
#include "tensor/error.h"
#include "diag/nvml.h"
#include "diag/checks.h"

extern char** environ;

namespace mpt::diag {
namespace {

constexpr int kMptRunDefaultPort = 29500;  // tools/mpt-run's --master_port

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::optional<std::string>(v) : std::nullopt;
}

// A whole non-negative decimal number, or nothing.
std::optional<long> parse_count(const std::string& text) {
  long v = -1;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || v < 0) return std::nullopt;
  return v;
}

struct Resolved {
  std::string address;  // dotted IPv4
  std::string error;    // getaddrinfo's, when it failed
};

Resolved resolve(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
  if (rc != 0) return {"", ::gai_strerror(rc)};
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(found->ai_addr)->sin_addr, text, sizeof text);
  ::freeaddrinfo(found);
  return {text, ""};
}

// An address is this host's when a socket can bind to it.
bool is_local_address(const std::string& ipv4) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  ::inet_pton(AF_INET, ipv4.c_str(), &addr.sin_addr);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  ::close(fd);
  return ok;
}

// Whether rank 0's store could listen on `port` here (as TcpStore does:
// every interface, SO_REUSEADDR); the error when it could not.
std::string port_busy_reason(int port) {
  try {
    int bound = 0;
    dist::close_fd(dist::listen_tcp(port, &bound));
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

int some_free_port() {
  int bound = 0;
  dist::close_fd(dist::listen_tcp(0, &bound));
  return bound;
}

std::vector<std::string> interface_names() {
  std::vector<std::string> names;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return names;
  for (ifaddrs* i = list; i; i = i->ifa_next)
    if (std::find(names.begin(), names.end(), i->ifa_name) == names.end()) names.push_back(i->ifa_name);
  ::freeifaddrs(list);
  return names;
}

void check_variables(Section& s) {
  const char* core[] = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
  for (const char* name : core) {
    const auto v = env(name);
    s.data[name] = v ? nlohmann::ordered_json(*v) : nlohmann::ordered_json(nullptr);
  }
  const char* job[] = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"};
  std::vector<std::string> set, missing;
  for (const char* name : job) (env(name) ? set : missing).push_back(name);
  if (set.empty()) {
    s.note("not started as a distributed job: MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE are not set "
           "(mpt-run sets them for each rank; a single process needs none)");
  } else {
    std::string listed;
    for (const auto& n : set) listed += fmt::format("{}{}={}", listed.empty() ? "" : ", ", n, *env(n.c_str()));
    s.ok("set: " + listed);
    if (!missing.empty()) {
      std::string names;
      for (const auto& n : missing) names += (names.empty() ? "" : ", ") + n;
      s.problem(fmt::format("a distributed job needs all four of MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; "
                            "missing: {}",
                            names),
                fmt::format("export {} (or start the job with mpt-run, which sets all of them)", names));
    }
  }

  // Each number on its own, so that every bad one is reported.
  std::map<std::string, long> numbers;
  for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}) {
    const auto v = env(name);
    if (!v) continue;
    if (const auto n = parse_count(*v)) {
      numbers[name] = *n;
    } else {
      s.problem(fmt::format("{}='{}' is not a non-negative whole number", name, *v),
                fmt::format("export {}=<number>, as mpt-run does", name));
    }
  }
  if (numbers.count("WORLD_SIZE") && numbers["WORLD_SIZE"] < 1)
    s.problem("WORLD_SIZE=0: a job has at least one rank", "export WORLD_SIZE=<number of processes in the job>");
  if (numbers.count("RANK") && numbers.count("WORLD_SIZE") && numbers["WORLD_SIZE"] >= 1 &&
      numbers["RANK"] >= numbers["WORLD_SIZE"])
    s.problem(fmt::format("RANK={} is outside 0..{} (WORLD_SIZE={})", numbers["RANK"], numbers["WORLD_SIZE"] - 1,
                          numbers["WORLD_SIZE"]),
              "give each process a distinct RANK below WORLD_SIZE");
  if (numbers.count("LOCAL_RANK") && numbers.count("LOCAL_WORLD_SIZE") &&
      numbers["LOCAL_RANK"] >= numbers["LOCAL_WORLD_SIZE"])
    s.problem(fmt::format("LOCAL_RANK={} is outside 0..{} (LOCAL_WORLD_SIZE={})", numbers["LOCAL_RANK"],
                          numbers["LOCAL_WORLD_SIZE"] - 1, numbers["LOCAL_WORLD_SIZE"]),
              "give each process of a node a distinct LOCAL_RANK below LOCAL_WORLD_SIZE");
  const int gpus = cuda_device_count();
  if (numbers.count("LOCAL_RANK") && gpus > 0 && numbers["LOCAL_RANK"] >= gpus)
    s.problem(fmt::format("LOCAL_RANK={} but this process sees {} GPU{} (cuda:{} does not exist)",
                          numbers["LOCAL_RANK"], gpus, gpus == 1 ? "" : "s", numbers["LOCAL_RANK"]),
              fmt::format("start at most {} process{} per node (mpt-run --nproc_per_node {}), or widen "
                          "CUDA_VISIBLE_DEVICES",
                          gpus, gpus == 1 ? "" : "es", gpus));

  // What the library itself makes of them (also Open MPI's and Slurm's).
  if (!set.empty() && missing.empty()) {
    try {
      const dist::RendezvousConfig c = dist::config_from_env();
      s.ok(fmt::format("rendezvous (as mpt-train reads it): rank {} of {}, local rank {} of {}, master {}:{}", c.rank,
                       c.world_size, c.local_rank, c.local_world_size, c.master_addr, c.master_port));
    } catch (const Error& e) {
      bool reported = false;  // the checks above usually name it already
      for (const auto& f : s.findings) reported |= f.severity == Severity::problem;
      if (!reported) s.problem(e.what(), "fix the variable named, or start the job with mpt-run");
    }
  }
}

void check_visible_devices(Section& s) {
  const auto v = env("CUDA_VISIBLE_DEVICES");
  s.data["CUDA_VISIBLE_DEVICES"] = v ? nlohmann::ordered_json(*v) : nlohmann::ordered_json(nullptr);
  if (!v) {
    s.note("CUDA_VISIBLE_DEVICES not set: every GPU is visible");
    return;
  }
  if (v->empty() || *v == "-1") {
    s.warning(fmt::format("CUDA_VISIBLE_DEVICES='{}' hides every GPU", *v),
              "unset CUDA_VISIBLE_DEVICES, or list the GPUs to use (e.g. 0,1)");
    return;
  }
  s.ok(fmt::format("CUDA_VISIBLE_DEVICES={}", *v));
  if (const nvml::Library* nvml = nvml::Library::try_get()) {
    const int installed = nvml->device_count();
    size_t start = 0;
    while (start <= v->size()) {
      const size_t comma = v->find(',', start);
      const std::string item = v->substr(start, comma == std::string::npos ? std::string::npos : comma - start);
      if (const auto n = parse_count(item); n && *n >= installed)
        s.problem(fmt::format("CUDA_VISIBLE_DEVICES names GPU {}, but this machine has {} (0..{})", *n, installed,
                              installed - 1),
                  "list only installed GPUs (nvidia-smi -L shows them); CUDA ignores every entry after a bad one");
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
  }
}

void check_nccl_variables(Section& s) {
  nlohmann::ordered_json nccl = nlohmann::ordered_json::object();
  for (char** e = environ; *e; ++e) {
    const std::string entry = *e;
    if (entry.rfind("NCCL_", 0) != 0) continue;
    const size_t eq = entry.find('=');
    nccl[entry.substr(0, eq)] = eq == std::string::npos ? "" : entry.substr(eq + 1);
  }
  s.data["NCCL"] = nccl;
  if (nccl.empty()) s.note("no NCCL_* variables set (NCCL picks its transports itself)");
  for (const auto& [name, value] : nccl.items()) {
    const std::string v = value.get<std::string>();
    s.ok(fmt::format("{}={}", name, v));
    const bool on = v == "1" || v == "true";
    if (name == "NCCL_P2P_DISABLE" && on)
      s.warning("NCCL_P2P_DISABLE=1: GPUs exchange data through host memory, not NVLink or PCIe peer access",
                "unset NCCL_P2P_DISABLE unless a broken peer path needs it");
    if (name == "NCCL_SHM_DISABLE" && on)
      s.warning("NCCL_SHM_DISABLE=1: processes of one node talk through sockets instead of shared memory",
                "unset NCCL_SHM_DISABLE");
    if (name == "NCCL_IB_DISABLE" && on)
      s.note("NCCL_IB_DISABLE=1: no InfiniBand/RoCE between nodes (sockets instead)");
    if (name == "NCCL_SOCKET_IFNAME" && !v.empty()) {
      // A list of prefixes ("eth", "=eth0" exact, "^docker" excluded).
      const std::vector<std::string> have = interface_names();
      bool any = false, positive = false;
      size_t start = 0;
      while (start <= v.size()) {
        const size_t comma = v.find(',', start);
        std::string item = v.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        if (!item.empty() && item[0] != '^') {
          positive = true;
          const bool exact = item[0] == '=';
          if (exact) item = item.substr(1);
          for (const auto& n : have) any |= exact ? n == item : n.rfind(item, 0) == 0;
        }
        if (comma == std::string::npos) break;
        start = comma + 1;
      }
      std::string listed;
      for (const auto& n : have) listed += (listed.empty() ? "" : ", ") + n;
      if (positive && !any)
        s.problem(fmt::format("NCCL_SOCKET_IFNAME={} matches no network interface here ({})", v, listed),
                  "set NCCL_SOCKET_IFNAME to one of the interfaces listed, or unset it");
    }
  }
  if (!nccl.contains("NCCL_DEBUG"))
    s.note("NCCL_DEBUG not set: export NCCL_DEBUG=INFO to see the transports NCCL picks (P2P/NVLink, SHM, IB, socket)");
}

void check_rendezvous(Report& report, dist::Millis connect_timeout) {
  Section& s = report.add("network", "Rendezvous address and port");
  const auto addr = env("MASTER_ADDR");
  const auto port_text = env("MASTER_PORT");
  const auto rank_text = env("RANK");
  const std::optional<long> rank = rank_text ? parse_count(*rank_text) : std::optional<long>(0);
  // Rank 0 (or a process not yet given a rank) hosts the store; any other
  // rank connects to it.
  const bool hosts_store = rank && *rank == 0;

  int port = kMptRunDefaultPort;
  if (port_text) {
    const auto n = parse_count(*port_text);
    if (!n || *n < 1 || *n > 65535) {
      s.problem(fmt::format("MASTER_PORT='{}' is not a port number (1..65535)", *port_text),
                fmt::format("export MASTER_PORT={}", some_free_port()));
      return;
    }
    port = static_cast<int>(*n);
  }
  s.data["port"] = port;
  s.data["port_checked"] = hosts_store ? "bind here" : "not bound (rank 0 hosts it)";
  if (!hosts_store)
    s.note(fmt::format("MASTER_PORT {} not bound here: rank 0 hosts the store there (reachability checked below)",
                       port));
  if (hosts_store) {
    const std::string busy = port_busy_reason(port);
    s.data["port_free"] = busy.empty();
    const std::string which = port_text ? fmt::format("MASTER_PORT {}", port)
                                        : fmt::format("MASTER_PORT not set; mpt-run's default port {}", port);
    if (busy.empty()) {
      s.ok(fmt::format("{} is free on this host (checked by binding it, as rank 0's store will)", which));
    } else {
      const int other = some_free_port();
      const std::string text = fmt::format("{} is in use on this host: rank 0 cannot host its store there", which);
      const std::string fix = fmt::format("export MASTER_PORT={} (or mpt-run --master_port {}); {} is free now", other,
                                          other, other);
      if (port_text) s.problem(text, fix);
      else s.warning(text, fix);
    }
  }

  if (!addr) {
    s.note("MASTER_ADDR not set: nothing to resolve (mpt-run sets 127.0.0.1 for one node)");
    return;
  }
  const Resolved r = resolve(*addr);
  s.data["master_addr"] = *addr;
  if (!r.error.empty()) {
    s.data["resolves"] = false;
    s.problem(fmt::format("MASTER_ADDR '{}' does not resolve ({})", *addr, r.error),
              "use rank 0's IP address, or a host name that DNS or /etc/hosts knows on every node");
    return;
  }
  const bool local = is_local_address(r.address);
  s.data["resolves"] = true;
  s.data["address"] = r.address;
  s.data["local"] = local;
  s.ok(fmt::format("MASTER_ADDR {} resolves to {} ({})", *addr, r.address,
                   local ? "an address of this host" : "another host"));
  if (hosts_store && rank_text && !local)
    s.problem(fmt::format("RANK={} hosts the store, but MASTER_ADDR {} ({}) is not an address of this host", *rank,
                          *addr, r.address),
              "run rank 0 on that host, or set MASTER_ADDR to this host's address on every rank");

  if (hosts_store) {
    s.data["reachable"] = nullptr;
    s.note(fmt::format("reachability of {}:{} not checked: this process would host the store there, so nothing "
                       "listens yet",
                       r.address, port));
    return;
  }
  // Another rank: rank 0's store should answer by now. It is greeted as a
  // rank greets it, job token and all, so that another program on the port
  // is found here rather than by the job.
  const auto token = env("MPT_JOB_TOKEN");
  const dist::StoreProbe probe = dist::probe_store(r.address, port, connect_timeout, token.value_or(""));
  s.data["reachable"] = probe.answer != dist::StoreAnswer::unreachable;
  s.data["answer"] = dist::store_answer_name(probe.answer);
  const std::string other_program =
      fmt::format("MASTER_ADDR and MASTER_PORT must name rank 0's store, and another program listens there "
                  "(`ss -ltnp 'sport = :{}'` on {} names it): give the job a MASTER_PORT nothing else uses",
                  port, *addr);
  switch (probe.answer) {
    case dist::StoreAnswer::store:
      s.ok(fmt::format("{}:{} answers as rank 0's mptrain store and admits this job token (checked by greeting it "
                       "as a rank does)",
                       r.address, port));
      break;
    case dist::StoreAnswer::unreachable:
      s.warning(fmt::format("nothing accepted a TCP connection at {}:{} within {} ms: rank 0 is not up yet, or a "
                            "firewall blocks the port",
                            r.address, port, connect_timeout.count()),
                fmt::format("start rank 0 first (the other ranks wait for it), or open TCP port {} on {}", port,
                            *addr));
      break;
    case dist::StoreAnswer::refused:
      // Without a token here, the job may well have one that its launcher
      // gives its ranks: a rank would be admitted where this check was not.
      if (token)
        s.problem(probe.message, "give every process of the job the same MPT_JOB_TOKEN (mpt-run passes its own to "
                                 "its ranks; with several launchers, give each the same --job_token)");
      else
        s.warning(probe.message + " (MPT_JOB_TOKEN is not set here)",
                  "export the job's MPT_JOB_TOKEN and rerun mpt-doctor, as the job's launcher gives it to its ranks");
      break;
    case dist::StoreAnswer::other_version:
      s.problem(probe.message, "build mptrain from the same source on every host of the job");
      break;
    case dist::StoreAnswer::not_a_store:
    case dist::StoreAnswer::silent: s.problem(probe.message, other_program); break;
    case dist::StoreAnswer::greeting_failed:
      s.problem(fmt::format("rank 0's store at {}:{} broke off the greeting: {}", r.address, port, probe.message),
                "look at rank 0's output for the store's own error, and rerun");
      break;
  }
}

}  // namespace

void check_environment(Report& report, dist::Millis connect_timeout) {
  Section& s = report.add("environment", "Distributed variables");
  check_variables(s);
  // Without a GPU, CUDA_VISIBLE_DEVICES and NCCL's variables have nothing
  // to act on.
  if (machine_has_gpu()) {
    check_visible_devices(s);
    check_nccl_variables(s);
  }
  check_rendezvous(report, connect_timeout);
}

}  // namespace mpt::diag
