#include "parallel/tcp_store.h"

#include <sys/socket.h>

#include <cstring>
#include <map>
#include <thread>

#include "parallel/distributed_error.h"
#include "parallel/socket_util.h"

namespace mpt::dist {

// Wire format, both directions: [u8 command or status][u32 key length][key]
// [u32 value length][value]. Small messages, one request in flight per
// connection, so a plain blocking protocol is enough.
enum class TcpStore::Command : uint8_t { set = 1, try_get = 2, add = 3, check = 4 };

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
    try {
      for (;;) {
        uint8_t cmd = 0;
        std::string key;
        Bytes value;
        recv_message(fd, &cmd, &key, &value, "TcpStore server");
        uint8_t status = 1;
        Bytes reply;
        {
          std::lock_guard lock(mutex_);
          switch (static_cast<TcpStore::Command>(cmd)) {
            case TcpStore::Command::set: data_[key] = std::move(value); break;
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
