// The NCCL backend: one non-blocking communicator per group and a
// communication stream of its own, so DDP's bucket all-reduces overlap the
// backward kernels on the compute stream. Each collective waits (on the
// GPU) for the work queued so far on the caller's current stream, runs on
// the communication stream, and records an event that Work::wait() polls
// together with ncclCommGetAsyncError: a dead peer or a stuck collective
// ends in an error within the timeout, never in a hang. Collectives
// recorded into a CUDA graph get the same bound at each replay, from a
// watchdog thread (ReplayWatchdog).
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

#include "parallel/cuda/nccl_util.h"
#include "parallel/cuda/peer_all_reduce.h"
#include "parallel/distributed_error.h"
#include "parallel/nccl_process_group.h"
#include "parallel/rendezvous.h"
#include "parallel/socket_util.h"
#include "tensor/cuda/check.h"
#include "tensor/cuda/graph.h"
#include "tensor/cuda/runtime.h"
#include "tensor/device_guard.h"
#include "tensor/gpu_timeline.h"
#include "tensor/host_name.h"
#include "tensor/operand_check.h"

namespace mpt::dist {

namespace {

// The group's communicator. A failure (an asynchronous error, or a wait
// past the timeout) aborts it, so no kernel stays stuck waiting for a peer;
// an aborted communicator must be neither used nor destroyed again.
class Communicator : public std::enable_shared_from_this<Communicator> {
 public:
  Communicator(std::shared_ptr<Store> store, int world_size) : store_(std::move(store)), world_size_(world_size) {}
  ~Communicator() {
    if (comm_ != nullptr && aborted_because_.empty()) {
      MPT_NCCL_RELEASE(ncclCommDestroy(comm_));
      // Registered windows end with the communicator; their memory after
      // it. After an abort it is left alone: kernels waiting for a dead
      // peer may still touch it.
      for (void* p : registered_) MPT_NCCL_RELEASE(ncclMemFree(p));
    }
  }
  ncclComm_t get() const { return comm_; }
  ncclComm_t* slot() { return &comm_; }

  // Runs f() under the lock abort() takes, so that no other thread (the
  // replay watchdog) aborts the communicator while f enqueues on it.
  template <typename F>
  void use(const std::string& what, F&& f) {
    std::lock_guard lock(mutex_);
    check<DistributedError>(aborted_because_.empty(),
                            "NCCL {}: the communicator was aborted by an earlier failure ({}); make a new process "
                            "group",
                            what, aborted_because_);
    f();
  }

  // NCCL's asynchronous error state (ncclInProgress while a non-blocking
  // call is still enqueuing), read under the same lock; empty once aborted.
  std::optional<ncclResult_t> async_error() {
    std::lock_guard lock(mutex_);
    if (!aborted_because_.empty()) return std::nullopt;
    ncclResult_t state = ncclSuccess;
    const ncclResult_t asked = ncclCommGetAsyncError(comm_, &state);
    return asked != ncclSuccess ? asked : state;
  }

  // Aborts once; `why` is kept for later calls. ncclCommAbort runs on a
  // thread nobody waits for: while a CUDA graph's kernels wait for a peer
  // that died it does not return (seen with NCCL 2.28 on two H200s), and
  // the failure must still reach the caller within its timeout. Marked
  // aborted at once, so nothing here uses the communicator again; the
  // thread keeps it alive until NCCL is done with it.
  void abort(const std::string& why) {
    std::lock_guard lock(mutex_);
    if (!aborted_because_.empty() || comm_ == nullptr) return;
    aborted_because_ = why;
    if (peer_) peer_->abort();
    std::thread([self = shared_from_this()] { MPT_NCCL_RELEASE(ncclCommAbort(self->comm_)); }).detach();
  }
  std::string aborted_because() {
    std::lock_guard lock(mutex_);
    return aborted_because_;
  }
  // NCCL cannot say which peer failed; the store knows who left the job.
  std::string who_left() { return describe_departures(*store_, world_size_); }

  // The group's own all-reduce kernels (ProcessGroupOptions::peer_collectives),
  // watched and aborted with the communicator. Set once, before their first use.
  void attach(std::shared_ptr<PeerAllReduce> peer) {
    std::lock_guard lock(mutex_);
    peer_ = std::move(peer);
    peer_seen_ = peer_.get();
  }
  // Read without the lock: the watchdog looks while use() holds it.
  PeerAllReduce* peer() const { return peer_seen_.load(std::memory_order_acquire); }

  // Memory from ncclMemAlloc registered with this communicator: freed when
  // the communicator is gone (tensors over it hold the communicator).
  void adopt_registered(void* memory) {
    std::lock_guard lock(mutex_);
    registered_.push_back(memory);
  }

 private:
  std::shared_ptr<Store> store_;
  int world_size_;
  std::vector<void*> registered_;
  std::shared_ptr<PeerAllReduce> peer_;
  std::atomic<PeerAllReduce*> peer_seen_{nullptr};
  ncclComm_t comm_ = nullptr;
  std::mutex mutex_;
  std::string aborted_because_;
};

// Runs f; on a failure of the communicator, aborts it and rethrows the
// error saying so.
template <typename F>
void aborting_on_failure(Communicator& comm, F&& f) {
  try {
    f();
  } catch (const TimeoutError& e) {
    comm.abort(e.what());
    throw TimeoutError(fmt::format("{}; communicator aborted; {}", e.what(), comm.who_left()));
  } catch (const DistributedError& e) {
    comm.abort(e.what());
    throw DistributedError(fmt::format("{}; communicator aborted; {}", e.what(), comm.who_left()));
  }
}

using Clock = std::chrono::steady_clock;

// One look at collectives that record `event` when they are done (an eager
// collective, or a graph's replay): true once they are. A peer that died or
// a network that broke shows up in NCCL's asynchronous error, not in the
// event, which would never complete; so: DistributedError on that error or
// an aborted communicator, TimeoutError past `timeout` since `since`. The
// group's own all-reduce kernels end by themselves when they give up, so
// their status word is read even once the event has completed.
// `what` names them in the message.
bool collectives_done(cudaEvent_t event, Communicator& comm, Clock::time_point since, Millis timeout,
                      const std::string& what) {
  const cudaError_t q = cudaEventQuery(event);
  if (q != cudaSuccess && q != cudaErrorNotReady) MPT_CUDA_CHECK(q);
  if (const PeerAllReduce* peer = comm.peer()) {
    if (const std::string why = peer->failure(); !why.empty()) {
      if (peer->timed_out()) throw TimeoutError(fmt::format("NCCL {}: {}", what, why));
      throw DistributedError(fmt::format("NCCL {}: {} ({})", what, why, comm.aborted_because()));
    }
  }
  if (q == cudaSuccess) return true;
  const std::optional<ncclResult_t> state = comm.async_error();
  if (!state)
    throw DistributedError(
        fmt::format("NCCL {}: the communicator was aborted meanwhile ({})", what, comm.aborted_because()));
  if (*state != ncclSuccess && *state != ncclInProgress)
    throw DistributedError(
        fmt::format("NCCL {}: {} (a peer failed or the network broke)", what, ncclGetErrorString(*state)));
  const auto waited = std::chrono::duration_cast<Millis>(Clock::now() - since);
  if (waited >= timeout)
    throw TimeoutError(fmt::format("NCCL {}: not finished after {} ms (timeout {} ms; a peer may be dead or stalled)",
                                   what, waited.count(), timeout.count()));
  return false;
}

// Between two looks of a wait that began at `start`. Collectives of a
// training step take microseconds: poll without sleeping at first (a 100 us
// sleep would be most of a small model's step), then back off so a long
// wait does not burn a core.
void pause_between_looks(Clock::time_point start) {
  if (Clock::now() - start < Millis(2)) std::this_thread::yield();
  else std::this_thread::sleep_for(std::chrono::microseconds(100));
}

// The id of the CUDA graph capture that `stream` records into, if any.
cudaError_t capture_of(cudaStream_t stream, std::optional<unsigned long long>& capture) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  const cudaError_t result = cudaStreamGetCaptureInfo(stream, &status, &id);
  capture.reset();
  if (result == cudaSuccess && status == cudaStreamCaptureStatusActive) capture = id;
  return result;
}

class NcclWork : public Work {
 public:
  NcclWork(int device, cudaStream_t caller, std::optional<unsigned long long> capture,
           std::shared_ptr<Communicator> comm, Millis timeout, std::string what, std::vector<Tensor> keep_alive)
      : device_(device), caller_(caller), capture_(capture), comm_(std::move(comm)), timeout_(timeout),
        what_(std::move(what)), keep_alive_(std::move(keep_alive)) {
    DeviceGuard guard(Device(DeviceType::cuda, device_));
    MPT_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
  }
  // Dropped without wait(): the tensors go back to the caching allocator
  // now, which hands their memory to the next request on the stream they
  // were made on (the caller's, as a rule) while NCCL may still read or
  // write it. So that stream waits for the collective, as after wait(); the
  // host does not. (Skipped where it cannot be done: the stream no longer
  // records into the capture the collective was launched in, or records
  // into one begun since; and after a failure, whose abort may leave the
  // collective's kernel where it was.)
  ~NcclWork() override {
    std::optional<unsigned long long> capture;
    if (!completed_ && comm_->aborted_because().empty() && capture_of(caller_, capture) == cudaSuccess &&
        capture == capture_)
      MPT_CUDA_RELEASE(cudaStreamWaitEvent(caller_, done_, 0));
    MPT_CUDA_RELEASE(cudaEventDestroy(done_));
  }

  cudaEvent_t event() const { return done_; }

  bool is_completed() override {
    std::lock_guard lock(mutex_);
    return completed_ || cudaEventQuery(done_) == cudaSuccess;
  }

  // Polls the event and the communicator's asynchronous error together
  // (collectives_done).
  //
  // While the caller's stream is being captured into a CUDA graph (a whole
  // DDP step, say) nothing runs yet and the host cannot wait: the stream
  // only waits for the collective inside the graph, and the group's
  // ReplayWatchdog bounds each replay instead.
  void wait() override {
    std::lock_guard lock(mutex_);
    if (completed_) return;
    const std::string earlier = comm_->aborted_because();
    check<DistributedError>(earlier.empty(), "NCCL {}: the communicator was aborted by an earlier failure ({})",
                            what_, earlier);
    const cudaStream_t caller = cuda::current_cuda_stream(device_);
    std::optional<unsigned long long> capture;
    MPT_CUDA_CHECK(capture_of(caller, capture));
    if (capture) {
      // A graph cannot wait for work outside it (CUDA would only say
      // "dependency created on uncaptured work in another stream").
      check<ValueError>(capture == capture_,
                        "NCCL {}: wait() inside a CUDA graph capture for a collective launched {}; wait for it "
                        "before capturing, or launch it inside the capture",
                        what_, capture_ ? "inside another capture" : "before the capture began");
      MPT_CUDA_CHECK(cudaStreamWaitEvent(caller, done_, 0));
      completed_ = true;
      keep_alive_.clear();  // the graph's own memory pool holds the tensors
      return;
    }
    const auto start = Clock::now();
    aborting_on_failure(*comm_, [&] {
      while (!collectives_done(done_, *comm_, start, timeout_, what_)) pause_between_looks(start);
    });
    // Later kernels on the caller's stream see the result.
    MPT_CUDA_CHECK(cudaStreamWaitEvent(caller, done_, 0));
    completed_ = true;
    keep_alive_.clear();
  }

 private:
  int device_;
  cudaStream_t caller_;  // the stream the collective waited for
  std::optional<unsigned long long> capture_;  // the capture it was launched into, if any
  std::shared_ptr<Communicator> comm_;
  Millis timeout_;
  std::string what_;
  std::vector<Tensor> keep_alive_;  // the memory stays ours until the GPU is done with it
  cudaEvent_t done_ = nullptr;
  std::mutex mutex_;
  bool completed_ = false;
};

// The replays of CUDA graphs that hold this group's collectives (a whole
// DDP step, say), watched as Work::wait() watches an eager collective: an
// event recorded after each launch, NCCL's asynchronous error and the
// timeout. A replay that fails or outlasts the timeout aborts the
// communicator (in the background, see Communicator::abort), says why on
// stderr at once, and leaves its graph to give up the replays' memory; the
// next replay or collective throws the reason.
//
// Two parties watch. The host, before each replay, waits for the previous
// one: only one replay is ever queued, because an abort that ends a stalled
// peer's kernels frees what the kernels of replays queued behind them would
// use (and a host far ahead of the GPU blocks inside a launch). A thread
// watches while the host is busy elsewhere (blocked in a synchronization,
// say).
class ReplayWatchdog : public cuda::ReplayWatch {
 public:
  // Holds the communicator weakly: a graph kept after its group must not
  // keep the communicator, whose destruction the group's owner times.
  ReplayWatchdog(int device, std::weak_ptr<Communicator> comm, Millis timeout, const std::string& who)
      : device_(device), comm_(std::move(comm)), timeout_(timeout),
        what_(fmt::format("collectives replayed in a CUDA graph on {}", who)) {}

  ~ReplayWatchdog() override {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_one();
    if (thread_.joinable()) thread_.join();
    // Destroying an event a replay will still record is allowed.
    for (const Pending& p : pending_) MPT_CUDA_RELEASE(cudaEventDestroy(p.event));
    for (cudaEvent_t e : spare_) MPT_CUDA_RELEASE(cudaEventDestroy(e));
  }

  // Waits for the previous replay (polling, as Work::wait() does: a small
  // model's step is over in microseconds); throws once the communicator is
  // aborted.
  void before_replay() override {
    check_not_aborted();
    const auto start = Clock::now();
    std::unique_lock lock(mutex_);
    while (!pending_.empty()) {
      if (settle_oldest(lock) != Replay::running) continue;
      lock.unlock();
      pause_between_looks(start);
      lock.lock();
    }
    lock.unlock();
    check_not_aborted();
  }

  bool replays_abandoned() const override { return gave_up_; }

  void replay_launched(int device) override {
    std::unique_lock lock(mutex_);
    cudaEvent_t event = nullptr;
    if (spare_.empty()) {
      MPT_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    } else {
      event = spare_.back();
      spare_.pop_back();
    }
    MPT_CUDA_CHECK(cudaEventRecord(event, cuda::current_cuda_stream(device)));
    pending_.push_back({event, Clock::now()});
    if (!thread_.joinable()) thread_ = std::thread([this] { watch(); });
    lock.unlock();
    wake_.notify_one();
  }

 private:
  struct Pending {
    cudaEvent_t event;
    Clock::time_point since;  // when it was launched or its predecessor ended, whichever is later
  };
  enum class Replay { running, done, failed };

  void check_not_aborted() const {
    const auto comm = comm_.lock();
    check<DistributedError>(comm != nullptr, "NCCL {}: their process group is gone", what_);
    const std::string why = comm->aborted_because();
    check<DistributedError>(why.empty(),
                            "NCCL {}: the communicator was aborted by an earlier failure ({}); make a new process group",
                            what_, why);
  }

  void watch() {
    (void)cudaSetDevice(device_);
    std::unique_lock lock(mutex_);
    while (!stop_) {
      if (pending_.empty()) wake_.wait(lock);
      else if (settle_oldest(lock) == Replay::running) wake_.wait_for(lock, std::chrono::milliseconds(1));
    }
  }

  // Looks once at the oldest queued replay (`lock` holds mutex_, released
  // meanwhile): popped once it ended; on a failure the communicator is
  // aborted and nothing is left to watch.
  Replay settle_oldest(std::unique_lock<std::mutex>& lock) {
    const Pending oldest = pending_.front();
    lock.unlock();
    std::string failure;
    const Replay state = check_replay(oldest, failure);
    if (state == Replay::failed) give_up(failure);
    lock.lock();
    const bool still_oldest = !pending_.empty() && pending_.front().event == oldest.event;
    if (state == Replay::done && still_oldest) {
      pending_.pop_front();
      spare_.push_back(oldest.event);
      if (!pending_.empty()) pending_.front().since = std::max(pending_.front().since, Clock::now());
    } else if (state == Replay::failed) {
      for (const Pending& p : pending_) spare_.push_back(p.event);
      pending_.clear();
    }
    return state;
  }

  Replay check_replay(const Pending& p, std::string& failure) {
    const auto comm = comm_.lock();
    // The group is gone, or an eager collective's failure aborted it: nothing left to abort.
    if (!comm || !comm->aborted_because().empty()) return Replay::done;
    try {
      return collectives_done(p.event, *comm, p.since, timeout_, what_) ? Replay::done : Replay::running;
    } catch (const Error& e) {
      failure = e.what();
      return Replay::failed;
    }
  }

  // Aborts the communicator once, whichever party saw the failure first.
  void give_up(const std::string& failure) {
    if (gave_up_.exchange(true)) return;
    const auto comm = comm_.lock();
    if (!comm) return;
    const std::string why = fmt::format("{}; communicator aborted; {}", failure, comm->who_left());
    // Said at once: a host blocked in a synchronization gets no error (it
    // returns when the aborted kernels end, or, with a peer that died, may
    // not return at all); the next replay or collective throws this.
    fmt::print(stderr, "mptrain: {}\n", why);
    comm->abort(why);
  }

  const int device_;
  const std::weak_ptr<Communicator> comm_;
  const Millis timeout_;
  const std::string what_;  // names the replays in messages
  std::mutex mutex_;
  std::condition_variable wake_;  // a replay was launched, or stop
  std::deque<Pending> pending_;
  std::vector<cudaEvent_t> spare_;
  std::atomic<bool> gave_up_{false};
  bool stop_ = false;
  std::thread thread_;
};

// NCCL refuses two ranks on one GPU with "invalid usage", which names
// neither the ranks nor the GPU. So the ranks of a new group publish their
// GPU's UUID (unique to the physical GPU, where host names and PCI
// addresses repeat across cloned machines) with its host and PCI address
// first, and every rank refuses the same first pair that shares one.
void check_one_gpu_per_rank(Store& store, int64_t group_index, int rank, int size, int device) {
  char bus[32] = {};
  MPT_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof bus, device));
  cudaDeviceProp props{};
  MPT_CUDA_CHECK(cudaGetDeviceProperties(&props, device));
  std::string uuid;
  for (char byte : props.uuid.bytes) uuid += fmt::format("{:02x}", static_cast<unsigned char>(byte));
  auto key = [&](int r) { return fmt::format("mpt/nccl/{}/gpu_of_rank/{}", group_index, r); };
  // "uuid\nhost bus\ncuda:N": the GPU is the first line; the rest, the
  // index differing between processes whose CUDA_VISIBLE_DEVICES differ,
  // only names it.
  const std::string mine = fmt::format("{}\n{} {}\ncuda:{}", uuid, host_name(), bus, device);
  store.set(key(rank), mine);
  struct Gpu {
    std::string uuid, address = "?", index = "?";
  };
  std::vector<Gpu> gpus;
  for (int r = 0; r < size; ++r) {
    const std::string entry = r == rank ? mine : store.get_string(key(r));
    Gpu g;
    const size_t first = entry.find('\n'), second = entry.find('\n', first == std::string::npos ? first : first + 1);
    g.uuid = entry.substr(0, first);
    if (second != std::string::npos) {
      g.address = entry.substr(first + 1, second - first - 1);
      g.index = entry.substr(second + 1);
    }
    gpus.push_back(g);
  }
  for (int a = 0; a < size; ++a)
    for (int b = a + 1; b < size; ++b)
      check<DeviceError>(gpus[a].uuid != gpus[b].uuid,
                         "NCCL group (rank {} of {}): ranks {} ({} there) and {} ({} there) both drive the GPU at "
                         "host/PCI address {} (UUID {}); each rank needs a GPU of its own (under mpt-run, the GPU of "
                         "LOCAL_RANK)",
                         rank, size, a, gpus[a].index, b, gpus[b].index, gpus[a].address, gpus[a].uuid);
}

class NcclProcessGroup : public ProcessGroup {
 public:
  NcclProcessGroup(const std::shared_ptr<Store>& store, int rank, int size, int device,
                   const ProcessGroupOptions& options)
      : ProcessGroup(rank, size), device_(device), timeout_(options.timeout),
        peer_collectives_(options.peer_collectives), store_(store),
        comm_(std::make_shared<Communicator>(store, size)) {
    nccl::check_version();
    check_device_available(Device(DeviceType::cuda, device));
    DeviceGuard guard(Device(DeviceType::cuda, device_));
    const int64_t index = store->add(fmt::format("mpt/nccl/groups_of_rank/{}", rank), 1);
    check_one_gpu_per_rank(*store, index, rank, size, device);
    peer_prefix_ = fmt::format("mpt/nccl/{}/peer", index);
    const std::string key = fmt::format("mpt/nccl/{}/unique_id", index);
    ncclUniqueId id;
    if (rank == 0) {
      MPT_NCCL_CHECK(ncclGetUniqueId(&id));
      store->set(key, Bytes(id.internal, id.internal + sizeof id.internal));
    } else {
      const Bytes b = store->get(key);
      check<DistributedError>(b.size() == sizeof id.internal, "NCCL: the unique id in {} has {} bytes, expected {}",
                              store->describe(), b.size(), sizeof id.internal);
      std::memcpy(id.internal, b.data(), b.size());
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // every wait below is ours, and bounded
    MPT_NCCL_CHECK(ncclCommInitRankConfig(comm_->slot(), size, id, rank, &config));
    aborting_on_failure(*comm_, [&] {
      nccl::wait_for({comm_->get()}, timeout_,
                     fmt::format("communicator setup (rank {} of {}, cuda:{})", rank, size, device));
    });
    MPT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    MPT_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    replay_watchdog_ = std::make_shared<ReplayWatchdog>(device_, comm_, timeout_,
                                                        fmt::format("rank {} of {} (cuda:{})", rank, size, device));
  }

  ~NcclProcessGroup() override {
    if (ready_) MPT_CUDA_RELEASE(cudaEventDestroy(ready_));
    if (stream_) MPT_CUDA_RELEASE(cudaStreamDestroy(stream_));
  }

  std::string backend_name() const override { return "nccl"; }

  WorkPtr allreduce(const Tensor& t, ReduceOp op) override {
    check_tensor("allreduce", t);
    check_no_float8("allreduce", t);  // (broadcast and allgather move float8 as bytes)
    t.bump_version();
    if (PeerAllReduce* peer = comm_->peer(); peer != nullptr && peer->serves(t, op))
      return launch(fmt::format("allreduce({}) of {} by the peer kernel", reduce_op_name(op), describe(t)), {t},
                    [&](cudaStream_t s) { peer->enqueue(t, op, s); });
    return launch(fmt::format("allreduce({}) of {}", reduce_op_name(op), describe(t)), {t}, [&](cudaStream_t s) {
      MPT_NCCL_CHECK(ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), nccl::data_type(t.dtype()), nccl::red_op(op),
                                   comm_->get(), s));
    });
  }

  WorkPtr broadcast(const Tensor& t, int root) override {
    check_tensor("broadcast", t);
    check<ValueError>(root >= 0 && root < size(), "broadcast: root {} outside 0..{}", root, size() - 1);
    t.bump_version();
    return launch(fmt::format("broadcast of {} from rank {}", describe(t), root), {t}, [&](cudaStream_t s) {
      MPT_NCCL_CHECK(ncclBroadcast(t.data_ptr(), t.data_ptr(), t.numel(), nccl::data_type(t.dtype()), root, comm_->get(), s));
    });
  }

  WorkPtr allgather(const std::vector<Tensor>& outputs, const Tensor& input) override {
    check_tensor("allgather", input);
    check<ValueError>(static_cast<int>(outputs.size()) == size(), "allgather: {} outputs for a group of {} ranks",
                      outputs.size(), size());
    for (const auto& o : outputs) {
      check_tensor("allgather", o);
      check<ShapeError>(o.shape() == input.shape() && o.dtype() == input.dtype(),
                        "allgather: output {} does not match input {}", describe(o), describe(input));
    }
    for (const auto& o : outputs) o.bump_version();
    Tensor gathered = Tensor::empty({input.numel() * size()}, input.dtype(), input.device());
    std::vector<Tensor> keep = outputs;
    keep.push_back(input);
    keep.push_back(gathered);
    return launch(
        fmt::format("allgather of {}", describe(input)), keep,
        [&](cudaStream_t s) {
          MPT_NCCL_CHECK(ncclAllGather(input.data_ptr(), gathered.data_ptr(), input.numel(),
                                       nccl::data_type(input.dtype()), comm_->get(), s));
        },
        [&](cudaStream_t s) {
          const size_t n = input.nbytes();
          for (int r = 0; r < size(); ++r)
            MPT_CUDA_CHECK(cudaMemcpyAsync(outputs[r].data_ptr(), static_cast<char*>(gathered.data_ptr()) + n * r,
                                           n, cudaMemcpyDeviceToDevice, s));
        });
  }

  WorkPtr reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp op) override {
    check_tensor("reduce_scatter", input);
    check_no_float8("reduce_scatter", input);
    check_tensor("reduce_scatter", output);
    check<ShapeError>(input.numel() == output.numel() * size() && input.dtype() == output.dtype(),
                      "reduce_scatter: input {} must be {} chunks shaped like output {}", describe(input), size(),
                      describe(output));
    output.bump_version();
    return launch(fmt::format("reduce_scatter({}) of {}", reduce_op_name(op), describe(input)), {input, output},
                  [&](cudaStream_t s) {
                    MPT_NCCL_CHECK(ncclReduceScatter(input.data_ptr(), output.data_ptr(), output.numel(),
                                                     nccl::data_type(input.dtype()), nccl::red_op(op), comm_->get(), s));
                  });
  }

  // With peer_collectives: memory every rank maps, whose sums and averages
  // the group's own kernel all-reduces (PeerAllReduce); where some pair of
  // ranks cannot map each other's memory, none (said once on stderr).
  //
  // Else ncclMemAlloc'd memory in a symmetric window
  // (NCCL_WIN_COLL_SYMMETRIC): NCCL's symmetric kernels then serve
  // collectives on it, with less latency than its ring kernels on ordinary
  // memory. The window lasts as long as the communicator (deregistering is
  // collective, which a tensor's last release is not). Unlike the ring
  // kernels, NCCL 2.28's symmetric kernels were seen to keep waiting for a
  // dead peer after ncclCommAbort (two H200s, a graphed DDP step).
  Tensor registered_buffer(int64_t numel, DType dtype, const Device& device) override {
    check<DeviceError>(device.type == DeviceType::cuda && device.index == device_,
                       "registered_buffer: asked for {} but this rank's NCCL group drives cuda:{}", device.str(),
                       device_);
    check<ValueError>(numel > 0, "registered_buffer: {} elements", numel);
    std::lock_guard lock(mutex_);  // in order with every rank's other collective calls
    DeviceGuard guard(device);
    if (peer_collectives_) return peer_buffer(numel, dtype);
    const size_t bytes = static_cast<size_t>(numel) * dtype_size(dtype);
    const std::string what =
        fmt::format("registering a symmetric window of {} bytes on rank {} of {}", bytes, rank(), size());
    void* memory = nullptr;
    MPT_NCCL_CHECK(ncclMemAlloc(&memory, bytes));
    comm_->adopt_registered(memory);
    ncclWindow_t window = nullptr;
    aborting_on_failure(*comm_, [&] {
      comm_->use(what, [&] {
        MPT_NCCL_CHECK(ncclCommWindowRegister(comm_->get(), memory, bytes, &window, NCCL_WIN_COLL_SYMMETRIC));
        nccl::wait_for({comm_->get()}, timeout_, what);
      });
    });
    auto storage = std::make_shared<Storage>(memory, bytes, device, [comm = comm_](void*) {});
    return Tensor::view_of(std::move(storage), {numel}, {1}, 0, dtype);
  }

  WorkPtr barrier() override {
    Tensor one = Tensor::empty({1}, DType::f32, Device(DeviceType::cuda, device_));
    return launch("barrier", {one}, [&](cudaStream_t s) {
      MPT_NCCL_CHECK(ncclAllReduce(one.data_ptr(), one.data_ptr(), 1, ncclFloat32, ncclSum, comm_->get(), s));
    });
  }

 private:
  Tensor peer_buffer(int64_t numel, DType dtype) {
    if (!peer_asked_) {
      peer_asked_ = true;
      std::string why;
      if (auto peer = PeerAllReduce::connect(store_, peer_prefix_, rank(), size(), device_, timeout_, why))
        comm_->attach(std::move(peer));
      else
        fmt::print(stderr, "mptrain: NCCL group, rank {} of {}: no peer collectives ({}); ordinary memory instead\n",
                   rank(), size(), why);
    }
    PeerAllReduce* peer = comm_->peer();
    return peer != nullptr ? peer->buffer(numel, dtype) : Tensor();
  }

  void check_tensor(const char* op, const Tensor& t) const {
    check_collective_tensor(op, t, DeviceType::cuda);
    check<DeviceError>(t.device().index == device_, "{}: {} is on {}, but this rank's NCCL group drives cuda:{}", op,
                       describe(t), t.device().str(), device_);
  }

  // `then` queues work that reads the collective's result: it may only be
  // queued once the (non-blocking) communicator has finished enqueuing the
  // collective itself, or it would run first.
  template <typename F>
  WorkPtr launch(std::string what, std::vector<Tensor> keep_alive, F&& enqueue,
                 const std::function<void(cudaStream_t)>& then = nullptr) {
    std::lock_guard lock(mutex_);  // one enqueue at a time keeps every rank's order
    DeviceGuard guard(Device(DeviceType::cuda, device_));
    what = fmt::format("{} on rank {} of {}", what, rank(), size());
    const std::string earlier = comm_->aborted_because();
    check<DistributedError>(earlier.empty(),
                            "NCCL {}: the communicator was aborted by an earlier failure ({}); make a new process "
                            "group",
                            what, earlier);
    const cudaStream_t caller = cuda::current_cuda_stream(device_);
    std::optional<unsigned long long> capture;
    MPT_CUDA_CHECK(capture_of(caller, capture));
    // Recorded into a graph: its replays are watched instead of this Work.
    if (capture) cuda::watch_replays(replay_watchdog_);
    MPT_CUDA_CHECK(cudaEventRecord(ready_, caller));
    MPT_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
    const Device device(DeviceType::cuda, device_);
    gpu_stamp(device, [&] { return "nccl start: " + what; }, stream_);
    auto work = std::make_shared<NcclWork>(device_, caller, capture, comm_, timeout_,
                                           what, std::move(keep_alive));
    aborting_on_failure(*comm_, [&] {
      comm_->use(what, [&] {
        enqueue(stream_);
        nccl::wait_for({comm_->get()}, timeout_, what);  // a non-blocking comm may still be enqueuing
      });
    });
    if (then) then(stream_);
    gpu_stamp(device, "nccl end", stream_);
    MPT_CUDA_CHECK(cudaEventRecord(work->event(), stream_));
    return work;
  }

  int device_;
  Millis timeout_;
  bool peer_collectives_;
  bool peer_asked_ = false;
  std::string peer_prefix_;  // the store keys of PeerAllReduce::connect
  std::shared_ptr<Store> store_;
  std::shared_ptr<Communicator> comm_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  std::shared_ptr<ReplayWatchdog> replay_watchdog_;
  std::mutex mutex_;
};

}  // namespace

std::shared_ptr<ProcessGroup> new_nccl_process_group(const std::shared_ptr<Store>& store, int rank, int size,
                                                     int device, const ProcessGroupOptions& options) {
  return std::make_shared<NcclProcessGroup>(store, rank, size, device, options);
}

}  // namespace mpt::dist
