#include "parallel/tcp_store.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstdio>

#include <cstring>
#include <map>
#include <thread>

#include "parallel/distributed_error.h"
#include "parallel/socket_util.h"

namespace mpt::dist {

// Wire format, both directions: [u8 command or status][u32 key length][key]
// [u32 value length][value]. Small messages, one request in flight per
// connection, so a plain blocking protocol is enough. Every connection
// opens with `hello` (key: the protocol name, value: the job token); the
// server answers kWelcome or kRefused (value: why) and then closes.
enum class TcpStore::Command : uint8_t { set = 1, try_get = 2, add = 3, check = 4, hello = 5, set_ephemeral = 6 };

namespace {

void send_message(int fd, uint8_t head, const std::string& key, const Bytes& value, const std::string& what) {
  std::string msg(1, static_cast<char>(head));
  const uint32_t klen = static_cast<uint32_t>(key.size()), vlen = static_cast<uint32_t>(value.size());
  msg.append(reinterpret_cast<const char*>(&klen), 4).append(key);
  msg.append(reinterpret_cast<const char*>(&vlen), 4).append(value.begin(), value.end());
  send_all(fd, msg.data(), msg.size(), what);
}

void recv_message(int fd, uint8_t* head, std::string* key, Bytes* value, const std::string& what) {
  recv_all(fd, head, 1, what);
  uint32_t len = 0;
  recv_all(fd, &len, 4, what);
  key->resize(len);
  if (len) recv_all(fd, key->data(), len, what);
  recv_all(fd, &len, 4, what);
  value->resize(len);
  if (len) recv_all(fd, value->data(), len, what);
}

int64_t decode_int(const Bytes& b) {
  int64_t v = 0;
  if (b.size() == sizeof v) std::memcpy(&v, b.data(), sizeof v);
  return v;
}

constexpr const char* kProtocol = "mpt-tcp-store-1";
constexpr uint8_t kWelcome = 1, kRefused = 3;

// Equal tokens, compared in time that does not depend on where they
// differ (the length is no secret).
bool same_token(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

std::string peer_of(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "an unknown peer";
  char host[INET6_ADDRSTRLEN] = {};
  int port = 0;
  if (addr.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&addr);
    if (IN6_IS_ADDR_V4MAPPED(&a->sin6_addr))  // an IPv4 client of a dual-stack socket: show it as IPv4
      ::inet_ntop(AF_INET, &a->sin6_addr.s6_addr[12], host, sizeof host);
    else
      ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    port = ntohs(a->sin6_port);
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&addr);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    port = ntohs(a->sin_port);
  }
  return fmt::format("{}:{}", host, port);
}

Bytes encode_int(int64_t v) {
  Bytes b(sizeof v);
  std::memcpy(b.data(), &v, sizeof v);
  return b;
}

}  // namespace

// The server: one thread accepting, one per connected rank. It lives as
// long as rank 0's TcpStore.
class TcpStoreServer {
 public:
  TcpStoreServer(int port, const std::string& bind_address, std::string job_token)
      : job_token_(std::move(job_token)) {
    listen_fd_ = listen_tcp(port, &port_, bind_address);
    accept_thread_ = std::thread([this] { accept_loop(); });
  }
  ~TcpStoreServer() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
      for (int fd : client_fds_) ::shutdown(fd, SHUT_RDWR);
    }
    ::shutdown(listen_fd_, SHUT_RDWR);  // wakes accept()
    accept_thread_.join();
    for (auto& t : client_threads_) t.join();
    close_fd(listen_fd_);
    for (int fd : client_fds_) close_fd(fd);
  }
  int port() const { return port_; }
  std::vector<std::string> refused() const {
    std::lock_guard lock(mutex_);
    return refused_;
  }

 private:
  // The connection's first message must be a hello with this job's token.
  bool admit(int fd) {
    uint8_t cmd = 0;
    std::string key;
    Bytes value;
    recv_message(fd, &cmd, &key, &value, "TcpStore server");
    std::string why;
    if (static_cast<TcpStore::Command>(cmd) != TcpStore::Command::hello || key != kProtocol)
      why = fmt::format("it did not open with the store's greeting (protocol '{}')", kProtocol);
    else if (!same_token(std::string(value.begin(), value.end()), job_token_))
      why = "its job token (MPT_JOB_TOKEN) differs from this job's: it belongs to another job";
    if (why.empty()) {
      send_message(fd, kWelcome, "", {}, "TcpStore server");
      return true;
    }
    const std::string line =
        fmt::format("TcpStore server on port {}: refused the connection from {}: {}", port_, peer_of(fd), why);
    std::fprintf(stderr, "%s\n", line.c_str());
    {
      std::lock_guard lock(mutex_);
      refused_.push_back(line);
    }
    send_message(fd, kRefused, "", Bytes(why.begin(), why.end()), "TcpStore server");
    return false;
  }

  void accept_loop() {
    for (;;) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      std::lock_guard lock(mutex_);
      if (stopping_) {
        if (fd >= 0) close_fd(fd);
        return;
      }
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        return;
      }
      client_fds_.push_back(fd);
      client_threads_.emplace_back([this, fd] { serve(fd); });
    }
  }

  // A connection's ephemeral keys go when it closes; each leaves behind
  // "<key>/departed" holding the order of the departure (1, 2, ...).
  void depart(const std::vector<std::string>& keys) {
    std::lock_guard lock(mutex_);
    for (const auto& key : keys) {
      data_.erase(key);
      data_[key + "/departed"] = encode_int(++departures_);
    }
  }

  void serve(int fd) {
    std::vector<std::string> ephemeral;
    try {
      if (!admit(fd)) {
        ::shutdown(fd, SHUT_RDWR);
        return;
      }
      for (;;) {
        uint8_t cmd = 0;
        std::string key;
        Bytes value;
        try {
          recv_message(fd, &cmd, &key, &value, "TcpStore server");
        } catch (const Error&) {
          depart(ephemeral);
          throw;
        }
        uint8_t status = 1;
        Bytes reply;
        {
          std::lock_guard lock(mutex_);
          switch (static_cast<TcpStore::Command>(cmd)) {
            case TcpStore::Command::set: data_[key] = std::move(value); break;
            case TcpStore::Command::set_ephemeral:
              data_[key] = std::move(value);
              ephemeral.push_back(key);
              break;
            case TcpStore::Command::try_get: {
              auto it = data_.find(key);
              if (it == data_.end()) status = 0;
              else reply = it->second;
              break;
            }
            case TcpStore::Command::add: {
              auto& slot = data_[key];
              const int64_t sum = decode_int(slot) + decode_int(value);
              slot = encode_int(sum);
              reply = slot;
              break;
            }
            case TcpStore::Command::check: status = data_.count(key) ? 1 : 0; break;
            default: status = 2;
          }
        }
        send_message(fd, status, "", reply, "TcpStore server");
      }
    } catch (const Error&) {
      // The client went away (finished, or died); its rank's own errors
      // surface on the client side.
    }
  }

  const std::string job_token_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::thread accept_thread_;
  mutable std::mutex mutex_;
  std::vector<std::string> refused_;
  int64_t departures_ = 0;
  bool stopping_ = false;
  std::vector<int> client_fds_;
  std::vector<std::thread> client_threads_;
  std::map<std::string, Bytes> data_;
};

TcpStore::TcpStore(std::string host, int port, bool is_master, Millis timeout, TcpStoreOptions options)
    : Store(timeout), host_(std::move(host)), port_(port) {
  mpt::check<ValueError>(timeout.count() > 0, "TcpStore({}:{}): timeout must be positive, got {} ms", host_, port,
                    timeout.count());
  std::string connect_to = host_;
  if (is_master) {
    server_ = std::make_unique<TcpStoreServer>(port, options.bind_address, options.job_token);
    port_ = server_->port();
    // The master reaches its own server where it listens.
    const std::string& b = options.bind_address;
    connect_to = b.empty() || b == "0.0.0.0" ? "127.0.0.1" : b == "::" ? "::1" : b;
  }
  fd_ = connect_tcp(connect_to, port_, timeout);
  set_io_timeout(fd_, timeout);
  try {
    greet(options.job_token);
  } catch (...) {
    close_fd(fd_);
    throw;
  }
}

void TcpStore::greet(const std::string& job_token) {
  const std::string what = fmt::format("TcpStore {} (greeting)", describe());
  send_message(fd_, static_cast<uint8_t>(Command::hello), kProtocol, Bytes(job_token.begin(), job_token.end()), what);
  uint8_t status = 0;
  std::string unused;
  Bytes reason;
  recv_message(fd_, &status, &unused, &reason, what);
  mpt::check<DistributedError>(
      status == kWelcome,
      "TcpStore {}: the store refused this process: {}. Every process of a job needs the same MPT_JOB_TOKEN "
      "(mpt-run passes its own to the ranks it starts; with several launchers, give each the same --job_token)",
      describe(), std::string(reason.begin(), reason.end()));
}

std::vector<std::string> TcpStore::refused_connections() const {
  return server_ ? server_->refused() : std::vector<std::string>{};
}

TcpStore::~TcpStore() {
  close_fd(fd_);
  server_.reset();
}

std::string TcpStore::describe() const { return fmt::format("tcp://{}:{}", host_, port_); }

Bytes TcpStore::request(Command cmd, const std::string& key, const Bytes& value, bool* found) {
  std::lock_guard lock(mutex_);
  set_io_timeout(fd_, timeout());  // set_timeout() applies to the next request
  const std::string what = fmt::format("TcpStore {} (key '{}')", describe(), key);
  send_message(fd_, static_cast<uint8_t>(cmd), key, value, what);
  uint8_t status = 0;
  std::string unused;
  Bytes reply;
  recv_message(fd_, &status, &unused, &reply, what);
  mpt::check<DistributedError>(status != 2, "{}: the server did not understand command {}", what, int(cmd));
  if (found) *found = status == 1;
  return reply;
}

void TcpStore::set(const std::string& key, const Bytes& value) { request(Command::set, key, value); }

void TcpStore::set_ephemeral(const std::string& key, const Bytes& value) {
  request(Command::set_ephemeral, key, value);
}

int64_t TcpStore::departure_order(const std::string& key) { return add(key + "/departed", 0); }

Bytes TcpStore::get(const std::string& key) {
  bool found = false;
  Bytes value = request(Command::try_get, key, {}, &found);
  if (found) return value;
  wait({key});
  value = request(Command::try_get, key, {}, &found);
  mpt::check<DistributedError>(found, "TcpStore {}: key '{}' vanished after it appeared", describe(), key);
  return value;
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  return decode_int(request(Command::add, key, encode_int(delta)));
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  for (const auto& k : keys) {
    bool found = false;
    request(Command::check, k, {}, &found);
    if (!found) return false;
  }
  return true;
}

}  // namespace mpt::dist
