#include "parallel/gloo_process_group.h"

#ifdef MPT_WITH_GLOO

#include <signal.h>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>

#include <fmt/ranges.h>

#include "parallel/distributed_error.h"
#include "parallel/rendezvous.h"
#include "parallel/socket_util.h"
#include "parallel/tcp_store.h"
#include "parallel/work_queue.h"
#include "tensor/dtype_dispatch.h"
#include "tensor/host_name.h"
#include "tensor/operand_check.h"
#include "tensor/ops.h"

namespace mpt::dist {

namespace {

// Gloo's rendezvous talks to our store under a per-group prefix, so several
// groups (and the arrival marks) share one store.
class GlooStoreAdapter : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(dist::Store& store, std::string prefix) : store_(store), prefix_(std::move(prefix)) {}
  void set(const std::string& key, const std::vector<char>& data) override { store_.set(prefix_ + key, data); }
  std::vector<char> get(const std::string& key) override { return store_.get(prefix_ + key); }
  void wait(const std::vector<std::string>& keys) override { wait(keys, store_.timeout()); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> full;
    for (const auto& k : keys) full.push_back(prefix_ + k);
    store_.wait(full, timeout.count() > 0 ? timeout : store_.timeout());
  }

 private:
  dist::Store& store_;
  std::string prefix_;
};

// Element-wise reductions, computed in f32 for the 16-bit types.
template <typename T>
void reduce_sum(void* out, const void* a, const void* b, size_t n) {
  auto* o = static_cast<T*>(out);
  auto* x = static_cast<const T*>(a);
  auto* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>)
      o[i] = T(float(x[i]) + float(y[i]));
    else
      o[i] = static_cast<T>(x[i] + y[i]);
  }
}

template <typename T>
void reduce_max(void* out, const void* a, const void* b, size_t n) {
  auto* o = static_cast<T*>(out);
  auto* x = static_cast<const T*>(a);
  auto* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
      const float fx = float(x[i]), fy = float(y[i]);
      // NaN wins, so an overflow seen on any rank is seen by all.
      o[i] = (std::isnan(fx) || fx > fy) ? x[i] : y[i];
    } else if constexpr (std::is_floating_point_v<T>) {
      o[i] = (std::isnan(x[i]) || x[i] > y[i]) ? x[i] : y[i];
    } else {
      o[i] = std::max(x[i], y[i]);
    }
  }
}

// Gloo writes to its sockets without MSG_NOSIGNAL, so a write to a peer
// that just died would end this process by SIGPIPE, silently, instead of
// failing the collective with a message naming the peer. SIGPIPE is
// ignored unless the program installed a handler of its own.
void ignore_sigpipe() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
  });
}

bool is_timeout(const std::string& gloo_message) { return gloo_message.find("imed out") != std::string::npos; }

// The address this rank offers the others for Gloo's connections. This
// host's name is the last resort: it often resolves to a loopback address
// (127.0.1.1 on Debian), where no other host can reach it.
std::string local_hostname(const dist::Store& store, const ProcessGroupOptions& options) {
  if (!options.hostname.empty()) return options.hostname;
  if (auto* tcp = dynamic_cast<const TcpStore*>(&store)) {
    const std::string& h = tcp->host();
    // A master on loopback means a single-host job: stay on loopback too,
    // which works even where this host's name does not resolve.
    if (h == "localhost" || is_loopback(h)) return "127.0.0.1";
    // The address the store's connections show the other hosts reach
    // this one at (for the master, where their connections arrived).
    if (std::string address = tcp->address_for_peers(); !address.empty()) return address;
  }
  return host_name();
}

class GlooProcessGroup : public ProcessGroup {
 public:
  GlooProcessGroup(const std::shared_ptr<dist::Store>& store, int rank, int size, const ProcessGroupOptions& options)
      : ProcessGroup(rank, size), store_(store), timeout_(options.timeout) {
    ignore_sigpipe();
    gloo::transport::tcp::attr attr;
    std::string interface = options.interface;
    if (interface.empty() && options.hostname.empty())
      if (const char* env = std::getenv("GLOO_SOCKET_IFNAME")) interface = env;
    if (!interface.empty()) attr.iface = interface;
    else attr.hostname = local_hostname(*store, options);
    // The n-th group this rank creates meets the n-th group of the others.
    const int64_t index = store->add(fmt::format("mpt/gloo/groups_of_rank/{}", rank), 1);
    const std::string prefix = fmt::format("mpt/gloo/{}/", index);
    scope_ = prefix;
    try {
      auto device = gloo::transport::tcp::CreateDevice(attr);
      auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
      context->setTimeout(timeout_);
      GlooStoreAdapter adapter(*store, prefix);
      context->connectFullMesh(adapter, device);
      context_ = std::move(context);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw DistributedError(fmt::format(
          "Gloo process group (rank {} of {}, host '{}', interface '{}', store {}): connecting to the other ranks "
          "failed within {} ms: {}",
          rank, size, attr.hostname, attr.iface, store->describe(), timeout_.count(), e.what()));
    }
  }

  // Rank 0's store may be lingering for this rank after a failure: it
  // needs no answer from it any more.
  ~GlooProcessGroup() override { note_finished(*store_, scope_, rank()); }

  std::string backend_name() const override { return "gloo"; }

  WorkPtr allreduce(const Tensor& tensor, ReduceOp op) override {
    check_collective_tensor("allreduce", tensor, DeviceType::cpu);
    check_no_float8("allreduce", tensor);  // (broadcast and allgather move float8 as bytes)
    check<DTypeError>(op != ReduceOp::avg || is_floating(tensor.dtype()),
                      "allreduce(avg): {} is not a floating tensor; average floats, or sum integers", describe(tensor));
    tensor.bump_version();
    return queue_.enqueue([this, tensor, op] {
      guarded(fmt::format("allreduce({}) of {}", reduce_op_name(op), describe(tensor)), [&] {
        // The average divides before it sums, as NCCL's does for floats: an
        // average of finite values is finite (DDP's overlapped step counts
        // on it).
        if (op == ReduceOp::avg) prim::unary_(UnaryOp::affine, tensor, tensor, 1.0 / size(), 0.0);
        if (size() > 1) {
          dispatch_all(tensor.dtype(), [&](auto zero) {
            using T = decltype(zero);
            gloo::AllreduceOptions opts(context_);
            opts.setOutput(static_cast<T*>(tensor.data_ptr()), static_cast<size_t>(tensor.numel()));
            opts.setReduceFunction(op == ReduceOp::max ? &reduce_max<T> : &reduce_sum<T>);
            opts.setTag(next_tag());
            opts.setTimeout(timeout_);
            gloo::allreduce(opts);
          });
        }
      });
    });
  }

  WorkPtr broadcast(const Tensor& tensor, int root) override {
    check_collective_tensor("broadcast", tensor, DeviceType::cpu);
    check<ValueError>(root >= 0 && root < size(), "broadcast: root {} outside 0..{}", root, size() - 1);
    tensor.bump_version();
    return queue_.enqueue([this, tensor, root] {
      guarded(fmt::format("broadcast of {} from rank {}", describe(tensor), root), [&] {
        if (size() == 1) return;
        gloo::BroadcastOptions opts(context_);
        auto* bytes = static_cast<uint8_t*>(tensor.data_ptr());
        if (rank() == root) opts.setInput(bytes, tensor.nbytes());
        opts.setOutput(bytes, tensor.nbytes());
        opts.setRoot(root);
        opts.setTag(next_tag());
        opts.setTimeout(timeout_);
        gloo::broadcast(opts);
      });
    });
  }

  WorkPtr allgather(const std::vector<Tensor>& outputs, const Tensor& input) override {
    check_collective_tensor("allgather", input, DeviceType::cpu);
    check<ValueError>(static_cast<int>(outputs.size()) == size(), "allgather: {} outputs for a group of {} ranks",
                      outputs.size(), size());
    for (const auto& out : outputs) {
      check_collective_tensor("allgather", out, DeviceType::cpu);
      check<ShapeError>(out.shape() == input.shape() && out.dtype() == input.dtype(),
                        "allgather: output {} does not match input {}", describe(out), describe(input));
    }
    for (const auto& out : outputs) out.bump_version();
    return queue_.enqueue([this, outputs, input] {
      guarded(fmt::format("allgather of {}", describe(input)), [&] {
        const size_t n = input.nbytes();
        std::vector<uint8_t> gathered(n * static_cast<size_t>(size()));
        if (size() == 1) {
          std::memcpy(gathered.data(), input.data_ptr(), n);
        } else {
          gloo::AllgatherOptions opts(context_);
          opts.setInput(static_cast<uint8_t*>(input.data_ptr()), n);
          opts.setOutput(gathered.data(), gathered.size());
          opts.setTag(next_tag());
          opts.setTimeout(timeout_);
          gloo::allgather(opts);
        }
        for (int r = 0; r < size(); ++r) std::memcpy(outputs[r].data_ptr(), gathered.data() + n * r, n);
      });
    });
  }

  WorkPtr reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp op) override {
    check_collective_tensor("reduce_scatter", input, DeviceType::cpu);
    check_no_float8("reduce_scatter", input);
    check_collective_tensor("reduce_scatter", output, DeviceType::cpu);
    check<ShapeError>(input.dim() >= 1 && input.size(0) == output.size(0) * size() && output.dtype() == input.dtype() &&
                          input.numel() == output.numel() * size(),
                      "reduce_scatter: input {} must be {} chunks shaped like output {}", describe(input), size(),
                      describe(output));
    // Gloo has no general reduce-scatter over arbitrary types: reduce the
    // whole input, keep this rank's chunk. Same result, more traffic.
    Tensor scratch = prim::clone(input);
    WorkPtr reduced = allreduce(scratch, op);
    output.bump_version();
    return queue_.enqueue([this, output, scratch, reduced] {
      reduced->wait();
      const size_t n = output.nbytes();
      std::memcpy(output.data_ptr(), static_cast<const uint8_t*>(scratch.data_ptr()) + n * rank(), n);
    });
  }

  WorkPtr barrier() override {
    return queue_.enqueue([this] {
      guarded("barrier", [&] {
        if (size() == 1) return;
        gloo::BarrierOptions opts(context_);
        opts.setTag(next_tag());
        opts.setTimeout(timeout_);
        gloo::barrier(opts);
      });
    });
  }

 private:
  // Runs on the communication thread only: tags follow call order.
  uint32_t next_tag() { return tag_++; }

  // Turns Gloo's exceptions into ours, with the collective, rank and timeout.
  // After one collective failed the group is broken (its peers' state is
  // unknown): the collectives queued behind it fail at once, naming that
  // first failure, instead of each waiting out its own timeout.
  template <typename F>
  void guarded(const std::string& what, F&& f) {
    if (broken_)
      throw DistributedError(fmt::format("Gloo {} on rank {} of {}: not run, since an earlier collective failed: {}",
                                         what, rank(), size(), *broken_));
    const auto start = std::chrono::steady_clock::now();
    try {
      f();
    } catch (const Error& e) {
      broken_ = e.what();
      throw;
    } catch (const std::exception& e) {
      const std::string msg = e.what();
      const bool own_timeout = timed_out_in_full(msg, std::chrono::steady_clock::now() - start);
      // A survivor of a stalled peer: the others time out about now too, and
      // must not name this rank's exit as the cause.
      if (own_timeout) note_gave_up(*store_, rank());
      const std::string text = fmt::format("Gloo {} on rank {} of {} (timeout {} ms): {}; {}", what, rank(), size(),
                                           timeout_.count(), msg, peers_at_fault(own_timeout));
      broken_ = text;
      note_finished(*store_, scope_, rank());
      // Rank 0's store goes when its process ends: keep it for the others
      // to ask who left, until each has left, asked or closed its group
      // (note_finished). After a timeout, the others timed out at about the
      // same moment and have asked as long as this rank did, so a second
      // covers the ones that started a little later. After a broken
      // connection, a survivor may notice the death only at its own timeout
      // (Gloo now and then misses a closed connection), so the store stays
      // up to the collectives' timeout and a little more; without that, such
      // a survivor found the store gone and blamed rank 0.
      const Millis linger = own_timeout ? Millis(1000) : timeout_ + Millis(2000);
      linger_for_departures(*store_, scope_, rank(), size(), linger);
      if (is_timeout(msg)) throw TimeoutError(text);
      throw DistributedError(text);
    }
  }

  // Names the ranks behind a failure. A broken connection means a process
  // left: the store saw its connection close too, and knows who left first
  // (the survivors that fail after it leave later). A timeout means a peer
  // went silent: dead without closing its connections (its host or the
  // network went away, and then the store may be out of reach too), or
  // stalled. Gloo also reports some broken connections as timeouts, but
  // early.
  bool timed_out_in_full(const std::string& gloo_message, std::chrono::steady_clock::duration waited) const {
    return is_timeout(gloo_message) && waited >= timeout_ * 9 / 10;
  }
  std::string peers_at_fault(bool full_timeout) {
    std::vector<int> others;
    for (int r = 0; r < size(); ++r)
      if (r != rank()) others.push_back(r);
    if (full_timeout)
      return fmt::format("no answer from rank{} {} (stalled, or its host or the network went away); {}",
                         others.size() > 1 ? "s" : "", fmt::join(others, ", "), describe_departures(*store_, size()));
    return describe_departures(*store_, size());
  }

  std::shared_ptr<dist::Store> store_;
  Millis timeout_;
  std::string scope_;  // this group's keys in the store
  std::shared_ptr<gloo::Context> context_;
  uint32_t tag_ = 0;
  std::optional<std::string> broken_;  // the first failure (communication thread only)
  WorkQueue queue_;  // last: its thread stops before the context goes
};

}  // namespace

std::shared_ptr<ProcessGroup> new_gloo_process_group(const std::shared_ptr<Store>& store, int rank, int size,
                                                     const ProcessGroupOptions& options) {
  return std::make_shared<GlooProcessGroup>(store, rank, size, options);
}

}  // namespace mpt::dist

#else  // no Gloo in this build

namespace mpt::dist {

std::shared_ptr<ProcessGroup> new_gloo_process_group(const std::shared_ptr<Store>& store, int rank, int size,
                                                     const ProcessGroupOptions&) {
  throw NotAvailableError(fmt::format(
      "new_gloo_process_group (rank {} of {}, store {}): this build of mptrain has no Gloo; install libgloo-dev "
      "and reconfigure (MPT_WITH_GLOO=ON)",
      rank, size, store ? store->describe() : "none"));
}

}  // namespace mpt::dist

#endif
