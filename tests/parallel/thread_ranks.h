#pragma once
// Ranks as threads of one process: each thread joins a Gloo group over its
// own TcpStore connection and real TCP connections, then runs the test's body.
#include <exception>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "parallel/loopback_stores.h"
#include "parallel/process_group.h"

namespace mpt::testing {

using dist::Millis;
using dist::ProcessGroup;

// Runs body(group) on `world` ranks, each in its own thread.
inline void with_ranks(int world, const std::function<void(ProcessGroup&)>& body,
                       Millis timeout = std::chrono::milliseconds(10000)) {
  const auto stores = dist::loopback_stores(world, timeout);
  std::vector<std::exception_ptr> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        dist::ProcessGroupOptions options;
        options.timeout = timeout;
        options.hostname = "127.0.0.1";
        auto group = dist::new_process_group(stores[r], r, world, DeviceType::cpu, options);
        body(*group);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace mpt::testing
