#pragma once
// A TCP key-value store: rank 0 hosts the server (a thread in its own
// process), every rank (rank 0 too) talks to it as a client. Connecting
// retries until the timeout, so ranks may start in any order; a master that
// never answers gives a TimeoutError naming the address, the port and how
// long the rank waited.
//
// The server opens every connection with a banner (store_message.h), so a
// client that reached some other service at the address (a web server on
// MASTER_PORT, say) says so at once, naming host and port, instead of
// reading that service's reply as a store message.
//
// A job token keeps a stray process (another job that picked the same
// port, a rank restarted with the wrong variables) out: every connection
// opens with the client's token, and the server refuses one that differs,
// telling both sides. It guards against mistakes, not attackers: it travels
// in clear text.
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "parallel/store.h"

namespace mpt::dist {

class TcpStoreServer;

// 128 random bits as hex (from /dev/urandom): a job token for a job whose
// ranks all start on this host, so no other job can join it by mistake.
std::string random_job_token();

struct TcpStoreOptions {
  // Where the master's server listens: a name or address of this host;
  // empty: all interfaces.
  std::string bind_address;
  // Must be equal on the server and every client; empty is a token too.
  std::string job_token;
};

// What answered the store's greeting at an address (probe_store()).
enum class StoreAnswer {
  store,            // an mptrain store, which admitted the job token
  refused,          // an mptrain store that refused it (another job's, or another token)
  other_version,    // an mptrain store that speaks another protocol version
  not_a_store,      // another service: it answered something else, or closed unanswered
  silent,           // it accepted the connection but answered nothing within the timeout
  unreachable,      // nothing accepted a connection within the timeout
  greeting_failed,  // a store's banner came, then its answer to the greeting did not
};
const char* store_answer_name(StoreAnswer a);  // "store", "refused", ...

struct StoreProbe {
  StoreAnswer answer = StoreAnswer::unreachable;
  std::string message;  // what answered, naming host:port; "" for `store`
};

// Connects to host:port and greets it as every TcpStore client does (with
// `job_token`), then leaves: whether an mptrain store of this job is there.
// Says what answered instead of throwing; takes at most about twice
// `timeout` (connecting, then the answer). A store that refuses the token
// notes the refusal in its log and goes on serving.
StoreProbe probe_store(const std::string& host, int port, Millis timeout, const std::string& job_token);

class TcpStore : public Store {
 public:
  // is_master: also host the server on `port`. port 0 picks a free one (see
  // port()). Throws DistributedError when the port is taken, the server
  // refuses this client's job token, or what answers is not an mptrain
  // store of this version; TimeoutError when nothing answers.
  TcpStore(std::string host, int port, bool is_master, Millis timeout = kDefaultTimeout,
           TcpStoreOptions options = {});
  ~TcpStore() override;

  using Store::set;  // the text overload too
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  std::string describe() const override;

  // A key that lives as long as this client's connection: when the
  // connection closes (the process exited or died), the server removes it
  // and records the order of the departure, so the survivors of a failure
  // can tell which process left first.
  void set_ephemeral(const std::string& key, const Bytes& value);
  // 0 while the ephemeral `key` is held (or was never set); else 1 for the
  // first connection that closed, 2 for the next, ... Waits for the answer
  // at most `timeout` (default: the store's).
  int64_t departure_order(const std::string& key, std::optional<Millis> timeout = std::nullopt);
  // add(), waiting for the answer at most `timeout` (failure paths: a store
  // out of reach must not stretch them).
  int64_t add_within(const std::string& key, int64_t delta, Millis timeout);

  const std::string& host() const { return host_; }
  // The numeric address of this host that the job's other hosts reach it
  // at, as far as the store shows it: for the master, the one where a
  // connection from another host arrived; for another rank, the one its
  // own connection to the master leaves from (on a host with several
  // networks, the one that routes to the master). "" where the store shows
  // none (a job on one host, or only loopback connections so far).
  std::string address_for_peers() const;
  int port() const { return port_; }
  bool hosts_server() const { return server_ != nullptr; }
  // Master only: one line per connection the server refused (wrong job
  // token, or not a store client), oldest first.
  std::vector<std::string> refused_connections() const;

 private:
  friend class TcpStoreServer;  // shares the wire commands
  enum class Command : uint8_t;
  Bytes request(Command cmd, const std::string& key, const Bytes& value, bool* found = nullptr,
                std::optional<Millis> timeout = std::nullopt);
  void greet(const std::string& address, const std::string& job_token);

  std::string host_;
  int port_;
  std::unique_ptr<TcpStoreServer> server_;
  int fd_ = -1;
  // Why the connection was closed: a request whose send or reply failed
  // (a timeout included) leaves the stream at an unknown point, so a later
  // request could read the late reply as its own.
  std::string broken_;
  std::mutex mutex_;  // one request at a time on the connection
};

}  // namespace mpt::dist
