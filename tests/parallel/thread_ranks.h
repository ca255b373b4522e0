#pragma once
// Ranks as threads of one process: each thread joins a Gloo group over a
// real TcpStore and real TCP connections, then runs the test's body.
#include <exception>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "parallel/process_group.h"
#include "parallel/tcp_store.h"

namespace mpt::testing {

using dist::Millis;
using dist::ProcessGroup;

// Runs body(group) on `world` ranks, each in its own thread.
inline void with_ranks(int world, const std::function<void(ProcessGroup&)>& body,
                       Millis timeout = std::chrono::milliseconds(10000)) {
  auto master = std::make_shared<dist::TcpStore>("127.0.0.1", 0, true, timeout);
  std::vector<std::exception_ptr> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        std::shared_ptr<dist::Store> store =
            r == 0 ? std::static_pointer_cast<dist::Store>(master)
                   : std::make_shared<dist::TcpStore>("127.0.0.1", master->port(), false, timeout);
        dist::ProcessGroupOptions options;
        options.timeout = timeout;
        options.hostname = "127.0.0.1";
        auto group = dist::new_process_group(store, r, world, DeviceType::cpu, options);
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
