#include "parallel/socket_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <limits>
#include <thread>

#include "parallel/distributed_error.h"

namespace mpt::dist {

namespace {

// Binds `sock` to `address` (empty: every interface, IPv4 and IPv6); returns
// bind()'s result with errno set, or -1 with *resolve_error when the name
// does not resolve.
int bind_to(int sock, int family, const std::string& address, int port, std::string* resolve_error) {
  if (address.empty()) {
    if (family == AF_INET6) {
      // Dual-stack, so IPv4 clients reach it too; where the system refuses,
      // say so rather than listen for IPv6 clients alone.
      int off = 0;
      if (::setsockopt(sock, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof off) != 0) return -1;
      sockaddr_in6 addr{};
      addr.sin6_family = AF_INET6;
      addr.sin6_addr = in6addr_any;
      addr.sin6_port = htons(static_cast<uint16_t>(port));
      return ::bind(sock, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    }
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    return ::bind(sock, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  }
  addrinfo hints{};
  hints.ai_family = family;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const int gai = ::getaddrinfo(address.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (gai != 0) {
    *resolve_error = ::gai_strerror(gai);
    return -1;
  }
  const int rc = ::bind(sock, found->ai_addr, found->ai_addrlen);
  const int err = errno;
  ::freeaddrinfo(found);
  errno = err;
  return rc;
}

// The address family `address` resolves to first (AF_INET6 for "" so one
// socket serves both families).
int family_of(const std::string& address) {
  if (address.empty()) return AF_INET6;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(address.c_str(), nullptr, &hints, &found) != 0) return AF_INET;
  const int family = found->ai_family;
  ::freeaddrinfo(found);
  return family;
}

}  // namespace

int listen_tcp(int port, int* bound_port, const std::string& bind_address) {
  check<ValueError>(port >= 0 && port <= 65535, "TcpStore: port {} is outside 0..65535", port);
  const std::string where = bind_address.empty() ? "all interfaces" : fmt::format("address '{}'", bind_address);
  int family = family_of(bind_address);
  int sock = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (sock < 0 && bind_address.empty()) {  // no IPv6 on this host
    family = AF_INET;
    sock = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  }
  check<DistributedError>(sock >= 0, "TcpStore: socket() failed: {}", std::strerror(errno));
  int on = 1;
  // SO_REUSEADDR lets a restarted job reuse a port whose old connections
  // linger in TIME_WAIT; a port with a live listener still fails below.
  if (::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on) != 0) {
    const int err = errno;
    ::close(sock);
    throw DistributedError(fmt::format("TcpStore: cannot set SO_REUSEADDR: {}", std::strerror(err)));
  }
  std::string resolve_error;
  const int rc = bind_to(sock, family, bind_address, port, &resolve_error);
  if (rc != 0) {
    const int err = errno;
    ::close(sock);
    if (!resolve_error.empty())
      throw DistributedError(
          fmt::format("TcpStore: cannot bind to '{}': the name does not resolve: {}", bind_address, resolve_error));
    if (err == EADDRINUSE)
      throw DistributedError(fmt::format(
          "TcpStore: port {} is already in use on {} of this host (another job, or a stale process of an earlier "
          "one?); choose another MASTER_PORT",
          port, where));
    if (err == EADDRNOTAVAIL)
      throw DistributedError(fmt::format(
          "TcpStore: cannot bind port {} on {}: no interface of this host has that address (set "
          "MPT_STORE_BIND_ADDR to one of this host's addresses, or 0.0.0.0 for all)",
          port, where));
    throw DistributedError(fmt::format("TcpStore: cannot bind port {} on {}: {}", port, where, std::strerror(err)));
  }
  if (::listen(sock, 128) != 0) {
    const int err = errno;
    ::close(sock);
    throw DistributedError(fmt::format("TcpStore: listen on port {} failed: {}", port, std::strerror(err)));
  }
  sockaddr_storage got{};
  socklen_t len = sizeof got;
  ::getsockname(sock, reinterpret_cast<sockaddr*>(&got), &len);
  *bound_port = got.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&got)->sin6_port)
                                          : ntohs(reinterpret_cast<sockaddr_in*>(&got)->sin_port);
  return sock;
}

namespace {

// One connection attempt that gives up after `limit`: a blocking connect to
// an address that drops packets waits out the kernel's SYN retries (about
// two minutes), whatever the store's timeout. Returns the socket, blocking
// again, or -1 with *error set.
int connect_within(const addrinfo& a, Millis limit, std::string* error) {
  const int fd = ::socket(a.ai_family, a.ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a.ai_protocol);
  if (fd < 0) {
    *error = std::strerror(errno);
    return -1;
  }
  int err = ::connect(fd, a.ai_addr, a.ai_addrlen) == 0 ? 0 : errno;
  if (err == EINPROGRESS) {
    // Polled for what is left of `limit`, so signals cannot stretch it.
    const auto deadline = std::chrono::steady_clock::now() + limit;
    pollfd p{fd, POLLOUT, 0};
    int ready;
    do {
      const auto left = std::chrono::duration_cast<Millis>(deadline - std::chrono::steady_clock::now());
      ready = ::poll(&p, 1, static_cast<int>(std::clamp<int64_t>(left.count(), 1, std::numeric_limits<int>::max())));
    } while (ready < 0 && errno == EINTR && std::chrono::steady_clock::now() < deadline);
    if (ready < 0 && errno == EINTR) ready = 0;
    if (ready == 0) {
      err = ETIMEDOUT;
    } else if (ready < 0) {
      err = errno;
    } else {
      socklen_t len = sizeof err;
      if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
    }
  }
  const int flags = err == 0 ? ::fcntl(fd, F_GETFL) : -1;
  if (err == 0 && (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0)) err = errno;
  if (err != 0) {
    *error = std::strerror(err);
    ::close(fd);
    return -1;
  }
  return fd;
}

}  // namespace

int connect_tcp(const std::string& host, int port, Millis timeout) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  std::string last_error = "no attempt made";
  auto pause = Millis(10);
  for (;;) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const std::string service = std::to_string(port);
    const int gai = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found);
    if (gai != 0) {
      last_error = fmt::format("cannot resolve '{}': {}", host, ::gai_strerror(gai));
    } else {
      for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
        const auto left = timeout - std::chrono::duration_cast<Millis>(clock::now() - start);
        const int fd = connect_within(*a, std::max(left, Millis(1)), &last_error);
        if (fd < 0) continue;
        ::freeaddrinfo(found);
        // Requests are small and answered at once: no Nagle delay.
        int on = 1;
        if (::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on) != 0) {
          const int err = errno;
          ::close(fd);
          throw DistributedError(fmt::format("TcpStore: cannot set TCP_NODELAY: {}", std::strerror(err)));
        }
        return fd;
      }
      ::freeaddrinfo(found);
    }
    const auto waited = std::chrono::duration_cast<Millis>(clock::now() - start);
    if (waited >= timeout)
      throw TimeoutError(fmt::format(
          "TcpStore: could not reach the master at {}:{} after waiting {} ms (timeout {} ms); last error: {}. "
          "Is rank 0 running, and do MASTER_ADDR and MASTER_PORT point at it?",
          host, port, waited.count(), timeout.count(), last_error));
    std::this_thread::sleep_for(std::min(pause, timeout - waited));
    pause = std::min(pause * 2, Millis(200));
  }
}

void set_io_timeout(int fd, Millis timeout) {
  // A zero timeval means "block forever": a timeout of 0 ms becomes 1 ms.
  const int64_t ms = std::max<int64_t>(1, timeout.count());
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(ms / 1000);
  tv.tv_usec = static_cast<suseconds_t>((ms % 1000) * 1000);
  check<DistributedError>(::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) == 0 &&
                              ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) == 0,
                          "TcpStore: cannot set a socket timeout: {}", std::strerror(errno));
}

namespace {

// A send or recv that a signal interrupts (with a socket timeout set, the
// kernel never restarts it) starts its wait afresh: under a steady signal
// (a profiler's timer, say) it would never time out. This tells when the
// waiting since the last byte moved has used up the socket's timeout.
class InterruptedWait {
 public:
  InterruptedWait(int fd, int option) : fd_(fd), option_(option) {}
  void moved() { since_ = Clock::now(); }
  bool out_of_time() const {
    timeval tv{};
    socklen_t len = sizeof tv;
    if (::getsockopt(fd_, SOL_SOCKET, option_, &tv, &len) != 0 || (tv.tv_sec == 0 && tv.tv_usec == 0)) return false;
    return Clock::now() - since_ >= std::chrono::seconds(tv.tv_sec) + std::chrono::microseconds(tv.tv_usec);
  }

 private:
  using Clock = std::chrono::steady_clock;
  int fd_, option_;
  Clock::time_point since_ = Clock::now();
};

}  // namespace

void send_all(int fd, const void* data, size_t n, const std::string& what) {
  const char* p = static_cast<const char*>(data);
  InterruptedWait wait(fd, SO_SNDTIMEO);
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR && !wait.out_of_time()) continue;
    if (k < 0 && errno == EINTR) throw TimeoutError(fmt::format("{}: send timed out", what));
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
      throw TimeoutError(fmt::format("{}: send timed out", what));
    check<DistributedError>(k > 0, "{}: send failed: {}", what, std::strerror(errno));
    p += k;
    n -= static_cast<size_t>(k);
    wait.moved();
  }
}

void recv_all(int fd, void* data, size_t n, const std::string& what) {
  char* p = static_cast<char*>(data);
  InterruptedWait wait(fd, SO_RCVTIMEO);
  while (n > 0) {
    const ssize_t k = ::recv(fd, p, n, 0);
    if (k < 0 && errno == EINTR && !wait.out_of_time()) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
      throw TimeoutError(fmt::format("{}: no answer within the timeout", what));
    check<DistributedError>(k != 0, "{}: the other side closed the connection", what);
    check<DistributedError>(k > 0, "{}: recv failed: {}", what, std::strerror(errno));
    p += k;
    n -= static_cast<size_t>(k);
    wait.moved();
  }
}

void close_fd(int fd) {
  if (fd >= 0) ::close(fd);
}

std::string address_text(const sockaddr_storage& addr) {
  char text[INET6_ADDRSTRLEN] = {};
  const char* made = nullptr;
  if (addr.ss_family == AF_INET) {
    made = ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&addr)->sin_addr, text, sizeof text);
  } else if (addr.ss_family == AF_INET6) {
    const in6_addr& a = reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_addr;
    made = IN6_IS_ADDR_V4MAPPED(&a) ? ::inet_ntop(AF_INET, &a.s6_addr[12], text, sizeof text)
                                    : ::inet_ntop(AF_INET6, &a, text, sizeof text);
  }
  return made ? text : "";
}

int port_of(const sockaddr_storage& addr) {
  if (addr.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&addr)->sin_port);
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_port);
  return 0;
}

std::string local_address_of(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  if (fd < 0 || ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "";
  return address_text(addr);
}

bool is_loopback(const std::string& address) { return address.rfind("127.", 0) == 0 || address == "::1"; }

}  // namespace mpt::dist
