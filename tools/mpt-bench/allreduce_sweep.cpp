#include "tools/mpt-bench/allreduce_sweep.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <memory>

#include "parallel/device_threads.h"
#include "parallel/loopback_stores.h"
#include "parallel/process_group.h"
#include "tensor/graph.h"
#include "tensor/ops.h"
#include "tensor/stream.h"
#include "tools/mpt-bench/median.h"

namespace mpt::bench {

namespace {

// Each GPU's rank of a fresh group for `way`, with a buffer of `numel`
// elements in the memory that way runs on.
struct Ranks {
  std::vector<std::shared_ptr<dist::ProcessGroup>> groups;
  std::vector<Tensor> buffers;
};

Ranks join(dist::DeviceThreads& threads, const std::vector<Device>& devices, const std::string& way, int64_t numel,
           DType dtype) {
  const int n = static_cast<int>(devices.size());
  const auto timeout = std::chrono::milliseconds(60000);
  const auto stores = dist::loopback_stores(n, timeout);
  Ranks r{std::vector<std::shared_ptr<dist::ProcessGroup>>(n), std::vector<Tensor>(n)};
  threads.run([&](size_t i) {
    dist::ProcessGroupOptions options;
    options.timeout = timeout;
    options.peer_collectives = way == "peer";
    r.groups[i] = dist::new_process_group(stores[i], static_cast<int>(i), n, DeviceType::cuda, options,
                                          devices[i].index);
    r.buffers[i] = way == "nccl" ? Tensor::empty({numel}, dtype, devices[i])
                                 : r.groups[i]->registered_buffer(numel, dtype, devices[i]);
    check<NotAvailableError>(r.buffers[i].defined(), "mpt-bench: no {} memory on {} (see the message above)", way,
                             devices[i].str());
    prim::fill_(r.buffers[i], 0.0);  // sums of zeros stay finite however often they are summed
  });
  return r;
}

}  // namespace

int run_allreduce_sweep(const AllreduceSweepOptions& o) {
  for (const std::string& way : o.ways)
    check<ValueError>(way == "nccl" || way == "symmetric" || way == "peer",
                      "mpt-bench: unknown all-reduce way '{}' (nccl, symmetric, peer)", way);
  check<ValueError>(!o.sizes_kib.empty(), "mpt-bench: no all-reduce sizes");
  const int n = cuda_device_count();
  std::vector<Device> devices;
  for (int i = 0; i < n; ++i) devices.emplace_back(DeviceType::cuda, i);
  dist::DeviceThreads threads(devices);
  const int64_t largest = *std::max_element(o.sizes_kib.begin(), o.sizes_kib.end()) * 1024;
  constexpr int kEagerRuns = 3;  // CapturedStep's eager runs before it captures

  for (const std::string& way : o.ways) {
    Ranks ranks = join(threads, devices, way, largest / static_cast<int64_t>(dtype_size(o.dtype)), o.dtype);
    for (int64_t kib : o.sizes_kib) {
      const int64_t bytes = kib * 1024;
      const int64_t count = bytes / static_cast<int64_t>(dtype_size(o.dtype));
      std::vector<std::vector<double>> times(n);
      std::vector<char> graphed(n);
      threads.run([&](size_t i) {
        const Tensor part = prim::slice(ranks.buffers[i], 0, 0, count);
        CapturedStep step(devices[i], [&](const std::vector<Tensor>&) {
          for (int k = 0; k < o.per_replay; ++k) ranks.groups[i]->allreduce(part, dist::ReduceOp::sum);
        });
        Event start(devices[i], true), end(devices[i], true);
        for (int run = 0; run < kEagerRuns + o.warmup + o.replays; ++run) {
          start.record();
          step.run();
          end.record();
          end.synchronize();
          if (run >= kEagerRuns + o.warmup) times[i].push_back(start.elapsed_ms(end));
        }
        graphed[i] = step.replays() > 0;
      });
      double slowest = 0;
      for (const auto& t : times) slowest = std::max(slowest, median(t));
      const double us = slowest * 1000.0 / o.per_replay;
      const double bus_gbs = n > 1 ? static_cast<double>(bytes) * 2.0 * (n - 1) / n / (us * 1e3) : 0.0;
      std::cout << fmt::format(
                       "{{\"mode\": \"allreduce\", \"way\": \"{}\", \"gpus\": {}, \"dtype\": \"{}\", \"bytes\": {}, "
                       "\"us_median\": {:.2f}, \"bus_gb_per_s\": {:.1f}, \"cuda_graph\": {}, \"impl\": \"mptrain\"}}",
                       way, n, dtype_name(o.dtype), bytes, us, bus_gbs,
                       std::all_of(graphed.begin(), graphed.end(), [](char g) { return g != 0; }) ? "true" : "false")
                << std::endl;
    }
    // Each rank lets go of its group on its own thread, all at once (an
    // NCCL rank's teardown may wait for its peers').
    threads.run([&](size_t i) {
      ranks.buffers[i] = Tensor();
      ranks.groups[i].reset();
    });
  }
  return 0;
}

}  // namespace mpt::bench
