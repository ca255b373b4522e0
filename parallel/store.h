#pragma once
// Store: the small key-value service ranks use to find each other (Gloo's
// addresses, NCCL's unique id, arrival marks). Every wait is bounded by the
// store's timeout and fails with a TimeoutError naming the keys it waited
// for, so a misconfigured job stops instead of hanging.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace mpt::dist {

using Bytes = std::vector<char>;
using Millis = std::chrono::milliseconds;

// A few minutes, as torchrun does: long enough for a slow node to boot.
inline constexpr Millis kDefaultTimeout = std::chrono::minutes(5);

class Store {
 public:
  virtual ~Store() = default;

  virtual void set(const std::string& key, const Bytes& value) = 0;
  // Waits (up to timeout()) until `key` exists, then returns its value.
  virtual Bytes get(const std::string& key) = 0;
  // Adds `delta` to the integer stored at `key` (0 if absent); returns the sum.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Whether every key exists now (no waiting).
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // Waits until every key exists, or throws TimeoutError naming the missing ones.
  void wait(const std::vector<std::string>& keys);
  void wait(const std::vector<std::string>& keys, Millis timeout);

  Millis timeout() const { return Millis(timeout_ms_.load()); }
  // Positive (ValueError otherwise); threads may read it meanwhile.
  void set_timeout(Millis t);

  // Text helpers.
  void set(const std::string& key, const std::string& value) { set(key, Bytes(value.begin(), value.end())); }
  std::string get_string(const std::string& key);

  // Where this store lives, for messages ("tcp://10.0.0.1:29500").
  virtual std::string describe() const = 0;

 protected:
  explicit Store(Millis timeout) { set_timeout(timeout); }

 private:
  std::atomic<int64_t> timeout_ms_{0};
};

}  // namespace mpt::dist
