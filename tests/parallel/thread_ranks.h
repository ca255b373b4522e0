#pragma once
// Ranks as threads of one process: each thread joins a group (Gloo over real
// TCP connections, or NCCL) through its own TcpStore connection, then runs
// the test's body.
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

// Runs body(group, device) on `world` ranks, each in its own thread: Gloo
// ranks on the CPU, or NCCL ranks with rank r driving cuda:r.
inline void with_device_ranks(int world, DeviceType type,
                              const std::function<void(ProcessGroup&, const Device&)>& body, Millis timeout,
                              dist::ProcessGroupOptions base = {}) {
  const auto stores = dist::loopback_stores(world, timeout);
  std::vector<std::exception_ptr> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        dist::ProcessGroupOptions options = base;
        options.timeout = timeout;
        if (type == DeviceType::cpu) options.hostname = "127.0.0.1";
        const Device device(type, type == DeviceType::cpu ? 0 : r);  // rank r drives cuda:r
        auto group = dist::new_process_group(stores[r], r, world, type, options, device.index);
        body(*group, device);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// Runs body(group) on `world` Gloo ranks, each in its own thread.
inline void with_ranks(int world, const std::function<void(ProcessGroup&)>& body,
                       Millis timeout = std::chrono::milliseconds(10000)) {
  with_device_ranks(
      world, DeviceType::cpu, [&](ProcessGroup& group, const Device&) { body(group); }, timeout);
}

}  // namespace mpt::testing
