// All-reduce smoke tests with exact sums and nccl-tests' bandwidth figures:
//   algbw = bytes / time;  busbw = algbw * 2 (n - 1) / n   (all-reduce)
// busbw is what each link carried, comparable with the hardware's peak.
#include <chrono>
#include <exception>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "parallel/local_communicator.h"
#include "parallel/loopback_stores.h"
#include "parallel/process_group.h"
#include "tensor/error.h"
#include "tensor/ops.h"
#include "tensor/stream.h"
#include "diag/checks.h"

namespace mpt::diag {
namespace {

using Clock = std::chrono::steady_clock;

// Participant p holds (p + 1) * (i % 7 + 1) at element i, so the sum over n
// participants is n (n + 1) / 2 * (i % 7 + 1): small whole numbers, exact in f32.
Tensor pattern(int64_t elements, int participant) {
  std::vector<float> v(static_cast<size_t>(elements));
  for (int64_t i = 0; i < elements; ++i) v[i] = static_cast<float>((participant + 1) * (i % 7 + 1));
  return from_vector(v, {elements});
}

// The first element that differs from the expected sum, as a message ("" if none).
std::string check_sum(const Tensor& t, int participants, const std::string& who) {
  const std::vector<float> got = prim::to(t, kCPU).to_vector<float>();
  const float factor = static_cast<float>(participants * (participants + 1) / 2);
  for (size_t i = 0; i < got.size(); ++i) {
    const float want = factor * static_cast<float>(i % 7 + 1);
    if (got[i] != want)
      return fmt::format("{}: element {} of {} is {} after the all-reduce, expected {}", who, i, got.size(), got[i],
                         want);
  }
  return "";
}

std::string size_text(size_t bytes) {
  if (bytes >= (1u << 20)) return fmt::format("{} MiB", bytes >> 20);
  if (bytes >= (1u << 10)) return fmt::format("{} KiB", bytes >> 10);
  return fmt::format("{} B", bytes);
}

struct Timing {
  size_t bytes = 0;
  double seconds = 0;  // per all-reduce
  std::string error;   // a wrong sum or a failure
};

nlohmann::ordered_json record(const Timing& t, int n) {
  const double algbw = t.seconds > 0 ? static_cast<double>(t.bytes) / t.seconds / 1e9 : 0;
  const double busbw = algbw * 2.0 * (n - 1) / n;
  return {{"bytes", t.bytes}, {"time_us", t.seconds * 1e6}, {"algbw_gbps", algbw}, {"busbw_gbps", busbw},
          {"sums_correct", t.error.empty()}};
}

void report_timings(Section& s, const std::string& what, const std::vector<Timing>& timings, int n) {
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  for (const Timing& t : timings) {
    const nlohmann::ordered_json r = record(t, n);
    rows.push_back(r);
    if (!t.error.empty()) continue;
    s.ok(fmt::format("{} {:>8}: sums correct, {:9.1f} us, algbw {:7.2f} GB/s, busbw {:7.2f} GB/s", what,
                     size_text(t.bytes), r["time_us"].get<double>(), r["algbw_gbps"].get<double>(),
                     r["busbw_gbps"].get<double>()));
  }
  s.data["results"] = std::move(rows);
}

// Gloo: `ranks` threads, each with its own TcpStore client and process
// group, so the data really crosses TCP connections.
void gloo_check(Report& report, const CommOptions& o) {
  Section& s = report.add("comm_gloo", fmt::format("All-reduce over {} CPU ranks (Gloo)", o.gloo_ranks));
  s.data["ranks"] = o.gloo_ranks;
  const int n = o.gloo_ranks;
  std::vector<std::vector<Timing>> per_rank(n);
  std::vector<std::string> failures(n);
  bool not_built = false;
  try {
    const auto stores = dist::loopback_stores(n, o.timeout);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        try {
          dist::ProcessGroupOptions options;
          options.timeout = o.timeout;
          options.hostname = "127.0.0.1";
          auto group = dist::new_process_group(stores[r], r, n, DeviceType::cpu, options);
          for (size_t bytes : o.sizes) {
            const int64_t elements = static_cast<int64_t>(std::max<size_t>(bytes / 4, 1));
            Timing t{static_cast<size_t>(elements) * 4, 0, ""};
            for (int it = -1; it < o.iterations; ++it) {  // iteration -1 warms up
              const Tensor x = pattern(elements, r);
              group->barrier()->wait();
              const auto start = Clock::now();
              group->allreduce(x, dist::ReduceOp::sum)->wait();
              if (it >= 0) t.seconds += std::chrono::duration<double>(Clock::now() - start).count();
              if (t.error.empty()) t.error = check_sum(x, n, fmt::format("rank {}", r));
            }
            t.seconds /= o.iterations;
            per_rank[r].push_back(t);
          }
        } catch (const NotAvailableError& e) {
          not_built = true;  // every rank finds the same
          failures[r] = e.what();
        } catch (const std::exception& e) {
          failures[r] = e.what();
        }
      });
    for (auto& t : threads) t.join();
  } catch (const std::exception& e) {
    failures[0] = e.what();
  }
  if (not_built) {
    s.warning(fmt::format("no Gloo in this build: {}", failures[0].empty() ? failures[1] : failures[0]),
              "install libgloo-dev (scripts/setup.sh does) and rebuild, for CPU ranks and DDP on the CPU");
    s.data["results"] = nullptr;
    return;
  }
  for (int r = 0; r < n; ++r)
    if (!failures[r].empty()) {
      s.problem(fmt::format("Gloo all-reduce failed on rank {}: {}", r, failures[r]),
                "check that loopback TCP works (127.0.0.1) and that no firewall blocks local ports");
      s.data["results"] = nullptr;
      return;
    }
  // The slowest rank's mean is the collective's time.
  std::vector<Timing> combined = per_rank[0];
  for (size_t k = 0; k < combined.size(); ++k)
    for (int r = 1; r < n; ++r) {
      combined[k].seconds = std::max(combined[k].seconds, per_rank[r][k].seconds);
      if (combined[k].error.empty()) combined[k].error = per_rank[r][k].error;
    }
  for (const Timing& t : combined)
    if (!t.error.empty())
      s.problem(fmt::format("Gloo all-reduce of {} gave a wrong sum: {}", size_text(t.bytes), t.error),
                "a wrong sum means corrupted transport or memory: rerun, and report it with this output");
  report_timings(s, "gloo", combined, n);
}

// NCCL: every local GPU in one process (DataParallel's clique). Timed with
// the host clock around `iterations` back-to-back calls between device
// synchronisations, as nccl-tests times a loop.
void nccl_check(Report& report, const CommOptions& o) {
  const int n = cuda_device_count();
  Section& s = report.add("comm_nccl", fmt::format("All-reduce over {} local GPU{} (NCCL)", n, n == 1 ? "" : "s"));
  s.data["gpus"] = n;
  if (n == 0) {
    s.note(cuda_built() ? "no CUDA device: NCCL check skipped" : "this build has no CUDA: NCCL check skipped");
    s.data["results"] = nullptr;
    return;
  }
  if (n == 1) s.note("one GPU: NCCL copies nothing between devices (busbw is 0 by definition)");
  std::vector<Device> devices;
  for (int i = 0; i < n; ++i) devices.emplace_back(DeviceType::cuda, i);
  std::vector<Timing> timings;
  try {
    const auto comm = dist::new_local_communicator(devices);
    auto sync_all = [&] {
      for (const Device& d : devices) synchronize(d);
    };
    for (size_t bytes : o.sizes) {
      const int64_t elements = static_cast<int64_t>(std::max<size_t>(bytes / 4, 1));
      Timing t{static_cast<size_t>(elements) * 4, 0, ""};
      std::vector<Tensor> xs;
      for (int i = 0; i < n; ++i) xs.push_back(prim::to(pattern(elements, i), devices[i]));
      comm->allreduce_sum(xs);  // warm-up, and the exact check
      sync_all();
      for (int i = 0; i < n && t.error.empty(); ++i) t.error = check_sum(xs[i], n, devices[i].str());
      const auto start = Clock::now();
      for (int it = 0; it < o.iterations; ++it) comm->allreduce_sum(xs);
      sync_all();
      t.seconds = std::chrono::duration<double>(Clock::now() - start).count() / o.iterations;
      timings.push_back(t);
      if (!t.error.empty())
        s.problem(fmt::format("NCCL all-reduce of {} gave a wrong sum: {}", size_text(t.bytes), t.error),
                  "a wrong sum across GPUs points at peer-to-peer transport: retry with NCCL_P2P_DISABLE=1 to "
                  "confirm, and check the PCIe/NVLink setup (nvidia-smi topo -m)");
    }
  } catch (const std::exception& e) {
    s.problem(fmt::format("NCCL all-reduce failed: {}", e.what()),
              "rerun with NCCL_DEBUG=INFO to see where NCCL stops");
    s.data["results"] = nullptr;
    return;
  }
  report_timings(s, "nccl", timings, n);
}

}  // namespace

void check_comm(Report& report, const CommOptions& options) {
  gloo_check(report, options);
  if (machine_has_gpu()) nccl_check(report, options);
}

}  // namespace mpt::diag
