#pragma once
// Two "hosts" on this machine: network namespaces joined by a veth pair,
// 10.77.0.1 and 10.77.0.2 on a /24 of their own (a namespace sees nothing
// of the machine's network, and nothing outside sees it). Needs root and
// iproute2; `error()` says why when they could not be made. The destructor
// deletes both namespaces, with the veth and whatever still runs there.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include <fmt/format.h>

namespace mpt::testing {

class NetnsHosts {
 public:
  NetnsHosts() {
    const int id = ::getpid();
    ns_[0] = fmt::format("mpt-host0-{}", id);
    ns_[1] = fmt::format("mpt-host1-{}", id);
    dev_[0] = fmt::format("mpv0-{}", id % 1000000);  // interface names: 15 characters at most
    dev_[1] = fmt::format("mpv1-{}", id % 1000000);
    if (::geteuid() != 0) {
      error_ = "network namespaces need root (CI runs as root)";
      return;
    }
    for (const std::string& cmd :
         {fmt::format("ip netns add {}", ns_[0]), fmt::format("ip netns add {}", ns_[1]),
          fmt::format("ip link add {} netns {} type veth peer name {} netns {}", dev_[0], ns_[0], dev_[1], ns_[1]),
          fmt::format("ip -n {} addr add {}/24 dev {}", ns_[0], address(0), dev_[0]),
          fmt::format("ip -n {} addr add {}/24 dev {}", ns_[1], address(1), dev_[1]),
          fmt::format("ip -n {} link set lo up", ns_[0]), fmt::format("ip -n {} link set lo up", ns_[1]),
          fmt::format("ip -n {} link set {} up", ns_[0], dev_[0]),
          fmt::format("ip -n {} link set {} up", ns_[1], dev_[1])}) {
      if (!run(cmd)) {
        error_ = fmt::format("'{}' failed: {}", cmd, output_);
        return;
      }
    }
  }
  ~NetnsHosts() {
    for (const auto& ns : ns_) run(fmt::format("ip netns pids {} | xargs -r kill -9; ip netns del {}", ns, ns));
  }
  NetnsHosts(const NetnsHosts&) = delete;
  NetnsHosts& operator=(const NetnsHosts&) = delete;

  const std::string& error() const { return error_; }  // empty when both hosts are up
  const std::string& name(int host) const { return ns_[host]; }
  const std::string& interface(int host) const { return dev_[host]; }
  static std::string address(int host) { return host == 0 ? "10.77.0.1" : "10.77.0.2"; }

  // Cuts the wire: host 0's end of the veth goes down (no packet passes,
  // no connection is closed).
  bool cut_link() { return run(fmt::format("ip -n {} link set {} down", ns_[0], dev_[0])); }

 private:
  bool run(const std::string& cmd) {
    output_.clear();
    FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
    if (p == nullptr) return false;
    char buf[512];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) output_.append(buf, n);
    const int status = ::pclose(p);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }

  std::string ns_[2], dev_[2];
  std::string error_, output_;
};

}  // namespace mpt::testing
