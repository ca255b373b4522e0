#include "parallel/store.h"

#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "parallel/distributed_error.h"
#include "tensor/error.h"

namespace mpt::dist {

void Store::set_timeout(Millis t) {
  mpt::check<ValueError>(t.count() > 0, "Store: the timeout must be positive, got {} ms", t.count());
  timeout_ms_.store(t.count());
}

void Store::wait(const std::vector<std::string>& keys) { wait(keys, timeout()); }

void Store::wait(const std::vector<std::string>& keys, Millis timeout) {
  const auto start = std::chrono::steady_clock::now();
  auto pause = Millis(1);
  while (!check(keys)) {
    const auto waited = std::chrono::duration_cast<Millis>(std::chrono::steady_clock::now() - start);
    if (waited >= timeout) {
      std::vector<std::string> missing;
      for (const auto& k : keys)
        if (!check({k})) missing.push_back(k);
      throw TimeoutError(fmt::format("Store::wait on {}: keys {} still missing after {} ms (timeout {} ms)",
                                     describe(), missing, waited.count(), timeout.count()));
    }
    std::this_thread::sleep_for(std::min(pause, timeout - waited));
    pause = std::min(pause * 2, Millis(50));  // quick for fast peers, cheap for slow ones
  }
}

std::string Store::get_string(const std::string& key) {
  const Bytes b = get(key);
  return std::string(b.begin(), b.end());
}

}  // namespace mpt::dist
