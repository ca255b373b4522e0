#include "parallel/tcp_store.h"

#include <sys/socket.h>

#include <cstring>
#include <map>
#include <thread>

#include "parallel/distributed_error.h"
#include "parallel/socket_util.h"
#include "parallel/store_message.h"

namespace mpt::dist {

// The wire format is in store_message.h. Small messages, one request in
// flight per connection, so a plain blocking protocol is enough.
enum class TcpStore::Command : uint8_t { set = 1, try_get = 2, add = 3, check = 4 };

namespace {

// The server's answer in a reply's head byte. `refused` carries the reason
// in the value: a malformed request, or one the store cannot carry out.
enum Status : uint8_t { missing = 0, ok = 1, unknown_command = 2, refused = 3 };

void send_message(int fd, uint8_t head, const std::string& key, const Bytes& value, const std::string& what) {
  const std::string msg = encode_store_message({head, key, value}, what);
  send_all(fd, msg.data(), msg.size(), what);
}

StoreMessage recv_message(int fd, const std::string& what) {
  return read_store_message([&](void* dst, size_t n) { recv_all(fd, dst, n, what); }, what);
}

// Keys go into messages; a huge one is shown by its start and its length.
std::string shown_key(const std::string& key) {
  constexpr size_t kShown = 64;
  return key.size() <= kShown ? key : fmt::format("{}... ({} bytes)", key.substr(0, kShown), key.size());
}

// An 8-byte counter (the server checks the size before it decodes).
int64_t decode_int(const Bytes& b) {
  int64_t v = 0;
  if (b.size() == sizeof v) std::memcpy(&v, b.data(), sizeof v);
  return v;
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
  explicit TcpStoreServer(int port) {
    listen_fd_ = listen_tcp(port, &port_);
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

 private:
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

  void serve(int fd) {
    const std::string what = "TcpStore server";
    try {
      for (;;) {
        const StoreMessage request = recv_message(fd, what);
        Bytes reply;
        const uint8_t status = execute(request, &reply);
        send_message(fd, status, "", reply, what);
      }
    } catch (const Error& e) {
      // A malformed message cannot be skipped (its lengths are not to be
      // trusted), so the connection ends; the client learns why, if it is
      // still there. A client that went away gets nothing: its rank's own
      // errors surface on its side.
      try {
        const std::string reason = e.what();
        send_message(fd, Status::refused, "", Bytes(reason.begin(), reason.end()), what);
      } catch (const Error&) {
      }
      ::shutdown(fd, SHUT_RDWR);
    }
  }

  // Carries out one well-formed request; returns the status, *reply the value.
  uint8_t execute(const StoreMessage& request, Bytes* reply) {
    std::lock_guard lock(mutex_);
    const std::string& key = request.key;
    switch (static_cast<TcpStore::Command>(request.head)) {
      case TcpStore::Command::set: data_[key] = request.value; return Status::ok;
      case TcpStore::Command::try_get: {
        auto it = data_.find(key);
        if (it == data_.end()) return Status::missing;
        *reply = it->second;
        return Status::ok;
      }
      case TcpStore::Command::add: {
        auto it = data_.find(key);
        std::string fault;
        int64_t sum = 0;
        if (request.value.size() != sizeof(int64_t))
          fault = fmt::format("the increment has {} bytes, not 8", request.value.size());
        else if (it != data_.end() && it->second.size() != sizeof(int64_t))
          fault = fmt::format("the key holds {} bytes, not an 8-byte counter", it->second.size());
        else if (__builtin_add_overflow(it == data_.end() ? 0 : decode_int(it->second), decode_int(request.value),
                                        &sum))
          fault = "the sum overflows 64 bits";
        if (!fault.empty()) {
          const std::string reason = fmt::format("add on key '{}': {}", shown_key(key), fault);
          *reply = Bytes(reason.begin(), reason.end());
          return Status::refused;
        }
        *reply = data_[key] = encode_int(sum);
        return Status::ok;
      }
      case TcpStore::Command::check: return data_.count(key) ? Status::ok : Status::missing;
    }
    return Status::unknown_command;
  }

  int listen_fd_ = -1;
  int port_ = 0;
  std::thread accept_thread_;
  std::mutex mutex_;
  bool stopping_ = false;
  std::vector<int> client_fds_;
  std::vector<std::thread> client_threads_;
  std::map<std::string, Bytes> data_;
};

TcpStore::TcpStore(std::string host, int port, bool is_master, Millis timeout)
    : Store(timeout), host_(std::move(host)), port_(port) {
  mpt::check<ValueError>(timeout.count() > 0, "TcpStore({}:{}): timeout must be positive, got {} ms", host_, port,
                    timeout.count());
  if (is_master) {
    server_ = std::make_unique<TcpStoreServer>(port);
    port_ = server_->port();
  }
  fd_ = connect_tcp(is_master ? "127.0.0.1" : host_, port_, timeout);
  set_io_timeout(fd_, timeout);
}

TcpStore::~TcpStore() {
  close_fd(fd_);
  server_.reset();
}

std::string TcpStore::describe() const { return fmt::format("tcp://{}:{}", host_, port_); }

Bytes TcpStore::request(Command cmd, const std::string& key, const Bytes& value, bool* found) {
  std::lock_guard lock(mutex_);
  const std::string what = fmt::format("TcpStore {} (key '{}')", describe(), shown_key(key));
  send_message(fd_, static_cast<uint8_t>(cmd), key, value, what);
  StoreMessage reply = recv_message(fd_, what);
  mpt::check<DistributedError>(reply.head != Status::unknown_command, "{}: the server did not understand command {}",
                               what, int(cmd));
  mpt::check<DistributedError>(reply.head != Status::refused, "{}: the server refused the request: {}", what,
                               std::string(reply.value.begin(), reply.value.end()));
  if (found) *found = reply.head == Status::ok;
  return std::move(reply.value);
}

void TcpStore::set(const std::string& key, const Bytes& value) { request(Command::set, key, value); }

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
