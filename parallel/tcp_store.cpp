#include "parallel/tcp_store.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstdio>

#include <cstring>
#include <chrono>
#include <fstream>
#include <list>
#include <map>
#include <thread>

#include "parallel/distributed_error.h"
#include "parallel/socket_util.h"
#include "parallel/store_message.h"

namespace mpt::dist {

// The wire format is in store_message.h. Small messages, one request in
// flight per connection, so a plain blocking protocol is enough. The server
// opens every connection with its banner; the client's first message is
// `hello` (key: the protocol name, value: the job token), which the server
// answers with kWelcome, or with kRefused (value: why) before it closes.
enum class TcpStore::Command : uint8_t {
  set = 1,
  try_get = 2,
  add = 3,
  check = 4,
  hello = kStoreHello,
  set_ephemeral = 6
};

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
  return fmt::format("{}:{}", address_text(addr), port_of(addr));
}

Bytes encode_int(int64_t v) {
  Bytes b(sizeof v);
  std::memcpy(b.data(), &v, sizeof v);
  return b;
}

// What a peer sent, for a message: printable ASCII as it is, other bytes as
// \xNN, up to the end of its first line and at most 60 characters.
std::string printable_start(const std::string& bytes) {
  std::string out;
  for (const unsigned char c : bytes) {
    if ((c == '\r' || c == '\n') && !out.empty()) break;
    if (out.size() >= 60) return out + "...";
    out += c >= 0x20 && c < 0x7f ? std::string(1, static_cast<char>(c)) : fmt::format("\\x{:02x}", c);
  }
  return out;
}

// A store of protocol version 1 sent no banner: it refused a later hello
// at once with a bare message (kRefused, an empty key).
bool looks_like_protocol_1(const std::string& bytes) {
  return bytes.size() >= 5 && bytes[0] == kRefused && bytes.compare(1, 4, std::string(4, '\0')) == 0;
}

// Greets the server on a connected socket, as every client does: the hello
// with the job token, then the server's banner and its answer. What
// answered is returned; a socket failure after a store's banner is thrown.
StoreProbe greet_server(int fd, const std::string& at, const std::string& job_token, Millis timeout) {
  const std::string what = fmt::format("the store's greeting to {}", at);
  set_io_timeout(fd, timeout);
  // The hello goes first: another kind of server (HTTP, say) answers only
  // once spoken to. A peer that has closed already may refuse it; its
  // closing is read below all the same.
  try {
    send_message(fd, kStoreHello, store_protocol_name(), Bytes(job_token.begin(), job_token.end()), what);
  } catch (const DistributedError&) {
  }
  std::string got;
  uint32_t version = 0;
  BannerState state;
  try {
    // A byte at a time: a stranger is told by its first byte that differs,
    // whether or not it sends as many bytes as a banner has.
    while ((state = read_store_banner(got, &version)) == BannerState::more) {
      char c;
      recv_all(fd, &c, 1, what);
      got += c;
    }
  } catch (const TimeoutError&) {
    return {StoreAnswer::silent,
            fmt::format("the service at {} accepted the connection but did not answer the store's greeting within "
                        "{} ms (an mptrain store answers at once): it is not an mptrain store, or its process is "
                        "stopped",
                        at, timeout.count())};
  } catch (const DistributedError&) {  // closed or reset
    return {StoreAnswer::not_a_store,
            got.empty() ? fmt::format("the service at {} is not an mptrain store: it closed the connection without "
                                      "answering the store's greeting",
                                      at)
                        : fmt::format("the service at {} is not an mptrain store (it answered '{}', then closed "
                                      "the connection)",
                                      at, printable_start(got))};
  }
  if (state == BannerState::stranger) {
    // More of what it sent at once, to show it.
    char more[64];
    if (const ssize_t n = ::recv(fd, more, sizeof more, MSG_DONTWAIT); n > 0) got.append(more, static_cast<size_t>(n));
    if (looks_like_protocol_1(got))
      return {StoreAnswer::other_version,
              fmt::format("the service at {} is an mptrain store of store protocol version 1 (it answered without "
                          "a banner); this process speaks version {}: run the same mptrain build on every host",
                          at, kStoreProtocolVersion)};
    return {StoreAnswer::not_a_store, fmt::format("the service at {} is not an mptrain store (it answered '{}')", at,
                                                  printable_start(got))};
  }
  if (state == BannerState::other_version)
    return {StoreAnswer::other_version,
            fmt::format("the service at {} is an mptrain store that speaks store protocol version {}; this process "
                        "speaks version {}: run the same mptrain build on every host",
                        at, version, kStoreProtocolVersion)};
  const StoreMessage answer = recv_message(fd, what);
  if (answer.head == kWelcome) return {StoreAnswer::store, ""};
  return {StoreAnswer::refused, fmt::format("the store at {} refused this process: {}", at,
                                            std::string(answer.value.begin(), answer.value.end()))};
}

}  // namespace

const char* store_answer_name(StoreAnswer a) {
  switch (a) {
    case StoreAnswer::store: return "store";
    case StoreAnswer::refused: return "refused";
    case StoreAnswer::other_version: return "other_version";
    case StoreAnswer::not_a_store: return "not_a_store";
    case StoreAnswer::silent: return "silent";
    case StoreAnswer::unreachable: return "unreachable";
    case StoreAnswer::greeting_failed: return "greeting_failed";
  }
  return "?";
}

StoreProbe probe_store(const std::string& host, int port, Millis timeout, const std::string& job_token) {
  int fd = -1;
  try {
    fd = connect_tcp(host, port, timeout);
  } catch (const Error& e) {
    return {StoreAnswer::unreachable, e.what()};
  }
  StoreProbe probe;
  try {
    probe = greet_server(fd, fmt::format("{}:{}", host, port), job_token, timeout);
  } catch (const Error& e) {
    probe = {StoreAnswer::greeting_failed, e.what()};
  }
  close_fd(fd);
  return probe;
}

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
      for (const Client& c : clients_)
        if (c.fd >= 0) ::shutdown(c.fd, SHUT_RDWR);
    }
    ::shutdown(listen_fd_, SHUT_RDWR);  // wakes accept()
    accept_thread_.join();
    for (Client& c : clients_) c.thread.join();  // each closes its own connection
    close_fd(listen_fd_);
  }
  int port() const { return port_; }
  // The address of this host that the latest connection from elsewhere
  // (not over loopback) arrived at; "" before any.
  std::string reached_at() const {
    std::lock_guard lock(mutex_);
    return reached_at_;
  }
  std::vector<std::string> refused() const {
    std::lock_guard lock(mutex_);
    return refused_;
  }

 private:
  struct Client {
    int fd = -1;        // -1 once closed
    bool done = false;  // its thread has nothing left to do but return
    std::thread thread;
  };

  // The connection's first message must be a hello of this protocol
  // version with this job's token.
  bool admit(int fd) {
    const StoreMessage greeting = recv_message(fd, "TcpStore server");
    const std::string protocol = store_protocol_name();
    const bool hello = static_cast<TcpStore::Command>(greeting.head) == TcpStore::Command::hello;
    std::string why;
    if (hello && greeting.key != protocol && greeting.key.rfind("mpt-tcp-store-", 0) == 0)
      why = fmt::format("it speaks store protocol '{}', this store '{}': run the same mptrain build on every host",
                        greeting.key, protocol);
    else if (!hello || greeting.key != protocol)
      why = fmt::format("it did not open with the store's greeting (protocol '{}')", protocol);
    else if (!same_token(std::string(greeting.value.begin(), greeting.value.end()), job_token_))
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
      const int error = errno;
      std::unique_lock lock(mutex_);
      if (stopping_) {
        if (fd >= 0) close_fd(fd);
        return;
      }
      if (fd < 0) {
        if (error == EINTR || error == ECONNABORTED) continue;
        // Out of descriptors or memory for now: connections that end give
        // some back, so wait and accept again rather than stop serving.
        if (error == EMFILE || error == ENFILE || error == ENOBUFS || error == ENOMEM) {
          lock.unlock();
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
          continue;
        }
        return;
      }
      // Threads of connections that have ended are joined here, so that
      // probes of the port over a long job leave nothing behind.
      clients_.remove_if([](Client& c) {
        if (!c.done) return false;
        c.thread.join();
        return true;
      });
      if (std::string local = local_address_of(fd); !local.empty() && !is_loopback(local)) reached_at_ = local;
      Client& client = clients_.emplace_back();
      client.fd = fd;
      client.thread = std::thread([this, &client] { serve_then_close(client); });
    }
  }

  // The connection's own thread closes it, under the lock (the destructor
  // shuts down the open ones), and says it is done as its last act.
  void serve_then_close(Client& client) {
    serve(client.fd);
    std::lock_guard lock(mutex_);
    close_fd(client.fd);
    client.fd = -1;
    client.done = true;
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
    const std::string what = "TcpStore server";
    std::vector<std::string> ephemeral;  // this connection's keys, dropped when it closes
    try {
      // Before anything is read: whatever a client sends, the banner tells
      // it that it reached an mptrain store, and of which version.
      const std::string banner = store_banner();
      send_all(fd, banner.data(), banner.size(), what);
      if (!admit(fd)) {
        ::shutdown(fd, SHUT_RDWR);
        return;
      }
      for (;;) {
        const StoreMessage request = recv_message(fd, what);
        Bytes reply;
        const uint8_t status = execute(request, &reply, ephemeral);
        send_message(fd, status, "", reply, what);
      }
    } catch (const Error& e) {
      depart(ephemeral);
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

  // Carries out one well-formed request; returns the status, *reply the
  // value. Keys set as ephemeral are added to `ephemeral`.
  uint8_t execute(const StoreMessage& request, Bytes* reply, std::vector<std::string>& ephemeral) {
    std::lock_guard lock(mutex_);
    const std::string& key = request.key;
    switch (static_cast<TcpStore::Command>(request.head)) {
      case TcpStore::Command::set: data_[key] = request.value; return Status::ok;
      case TcpStore::Command::set_ephemeral:
        data_[key] = request.value;
        ephemeral.push_back(key);
        return Status::ok;
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
      case TcpStore::Command::hello: break;  // only as the first message
    }
    return Status::unknown_command;
  }

  const std::string job_token_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::thread accept_thread_;
  mutable std::mutex mutex_;
  std::vector<std::string> refused_;
  std::string reached_at_;
  int64_t departures_ = 0;
  bool stopping_ = false;
  std::list<Client> clients_;  // a list: a thread holds its Client's address
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
  try {
    greet(connect_to, options.job_token);
  } catch (...) {
    close_fd(fd_);
    throw;
  }
}

void TcpStore::greet(const std::string& address, const std::string& job_token) {
  const StoreProbe answer = greet_server(fd_, fmt::format("{}:{}", address, port_), job_token, timeout());
  switch (answer.answer) {
    case StoreAnswer::store: return;
    case StoreAnswer::silent: throw TimeoutError(fmt::format("TcpStore {}: {}", describe(), answer.message));
    case StoreAnswer::refused:
      throw DistributedError(fmt::format(
          "TcpStore {}: {}. Every process of a job needs the same MPT_JOB_TOKEN (mpt-run passes its own to the "
          "ranks it starts; with several launchers, give each the same --job_token)",
          describe(), answer.message));
    case StoreAnswer::not_a_store:
      throw DistributedError(fmt::format(
          "TcpStore {}: {}. MASTER_ADDR and MASTER_PORT must name rank 0's store; another program listens there",
          describe(), answer.message));
    default: throw DistributedError(fmt::format("TcpStore {}: {}", describe(), answer.message));
  }
}

std::vector<std::string> TcpStore::refused_connections() const {
  return server_ ? server_->refused() : std::vector<std::string>{};
}

TcpStore::~TcpStore() {
  close_fd(fd_);
  server_.reset();
}

std::string TcpStore::describe() const { return fmt::format("tcp://{}:{}", host_, port_); }

std::string TcpStore::address_for_peers() const {
  // The master: where another host's connection to its server arrived.
  if (server_)
    if (std::string reached = server_->reached_at(); !reached.empty()) return reached;
  const std::string local = local_address_of(fd_);
  return is_loopback(local) ? "" : local;
}

Bytes TcpStore::request(Command cmd, const std::string& key, const Bytes& value, bool* found,
                        std::optional<Millis> timeout) {
  std::lock_guard lock(mutex_);
  const std::string what = fmt::format("TcpStore {} (key '{}')", describe(), shown_key(key));
  mpt::check<DistributedError>(broken_.empty(), "{}: the connection to the store was closed after an earlier "
                               "request failed: {}", what, broken_);
  check_store_limits(key.size(), value.size(), what);  // refused before any byte goes out: the connection stays good
  StoreMessage reply;
  try {
    set_io_timeout(fd_, timeout.value_or(this->timeout()));  // set_timeout() applies to the next request
    send_message(fd_, static_cast<uint8_t>(cmd), key, value, what);
    reply = recv_message(fd_, what);
  } catch (const std::exception& e) {
    broken_ = e.what();
    close_fd(fd_);
    fd_ = -1;
    throw;
  }
  mpt::check<DistributedError>(reply.head != Status::unknown_command, "{}: the server did not understand command {}",
                               what, int(cmd));
  mpt::check<DistributedError>(reply.head != Status::refused, "{}: the server refused the request: {}", what,
                               std::string(reply.value.begin(), reply.value.end()));
  if (found) *found = reply.head == Status::ok;
  return std::move(reply.value);
}

void TcpStore::set(const std::string& key, const Bytes& value) { request(Command::set, key, value); }

void TcpStore::set_ephemeral(const std::string& key, const Bytes& value) {
  request(Command::set_ephemeral, key, value);
}

int64_t TcpStore::departure_order(const std::string& key, std::optional<Millis> timeout) {
  return decode_int(request(Command::add, key + "/departed", encode_int(0), nullptr, timeout));
}

int64_t TcpStore::add_within(const std::string& key, int64_t delta, Millis timeout) {
  return decode_int(request(Command::add, key, encode_int(delta), nullptr, timeout));
}

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

std::string random_job_token() {
  std::ifstream urandom("/dev/urandom", std::ios::binary);
  unsigned char bytes[16] = {};
  urandom.read(reinterpret_cast<char*>(bytes), sizeof bytes);
  check<IOError>(static_cast<bool>(urandom), "cannot read /dev/urandom for a job token");
  std::string hex;
  for (unsigned char b : bytes) hex += fmt::format("{:02x}", b);
  return hex;
}

}  // namespace mpt::dist
