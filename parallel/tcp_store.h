#pragma once
// A TCP key-value store: rank 0 hosts the server (a thread in its own
// process), every rank (rank 0 too) talks to it as a client. Connecting
// retries until the timeout, so ranks may start in any order; a master that
// never answers gives a TimeoutError naming the address, the port and how
// long the rank waited.
#include <memory>
#include <mutex>
#include <string>

#include "parallel/store.h"

namespace mpt::dist {

class TcpStoreServer;

class TcpStore : public Store {
 public:
  // is_master: also host the server on `port` (all interfaces). port 0 picks
  // a free one (see port()). Throws DistributedError when the port is taken.
  TcpStore(std::string host, int port, bool is_master, Millis timeout = kDefaultTimeout);
  ~TcpStore() override;

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  std::string describe() const override;

  const std::string& host() const { return host_; }
  int port() const { return port_; }

 private:
  friend class TcpStoreServer;  // shares the wire commands
  enum class Command : uint8_t;
  Bytes request(Command cmd, const std::string& key, const Bytes& value, bool* found = nullptr);

  std::string host_;
  int port_;
  std::unique_ptr<TcpStoreServer> server_;
  int fd_ = -1;
  std::mutex mutex_;  // one request at a time on the connection
};

}  // namespace mpt::dist
