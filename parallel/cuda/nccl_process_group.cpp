// The NCCL backend: one non-blocking communicator per group and a
// communication stream of its own, so DDP's bucket all-reduces overlap the
// backward kernels on the compute stream. Each collective waits (on the
// GPU) for the work queued so far on the caller's current stream, runs on
// the communication stream, and records an event that Work::wait() polls
// together with ncclCommGetAsyncError: a dead peer or a stuck collective
// ends in an error within the timeout, never in a hang.
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <functional>
#include <mutex>
#include <thread>

#include "parallel/cuda/nccl_util.h"
#include "parallel/distributed_error.h"
#include "parallel/nccl_process_group.h"
#include "parallel/rendezvous.h"
#include "tensor/cuda/check.h"
#include "tensor/cuda/runtime.h"
#include "tensor/device_guard.h"

namespace mpt::dist {

namespace {

// The group's communicator. A failure (an asynchronous error, or a wait
// past the timeout) aborts it, so no kernel stays stuck waiting for a peer;
// an aborted communicator must be neither used nor destroyed again.
class Communicator {
 public:
  Communicator(std::shared_ptr<Store> store, int world_size) : store_(std::move(store)), world_size_(world_size) {}
  ~Communicator() {
    if (comm_ != nullptr && aborted_because_.empty()) ncclCommDestroy(comm_);
  }
  ncclComm_t get() const { return comm_; }
  ncclComm_t* slot() { return &comm_; }

  // Aborts once; `why` is kept for later calls.
  void abort(const std::string& why) {
    std::lock_guard lock(mutex_);
    if (!aborted_because_.empty() || comm_ == nullptr) return;
    ncclCommAbort(comm_);
    aborted_because_ = why;
  }
  std::string aborted_because() {
    std::lock_guard lock(mutex_);
    return aborted_because_;
  }
  // NCCL cannot say which peer failed; the store knows who left the job.
  std::string who_left() { return describe_departures(*store_, world_size_); }

 private:
  std::shared_ptr<Store> store_;
  int world_size_;
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
    throw TimeoutError(fmt::format("{}; communicator aborted", e.what()));
  } catch (const DistributedError& e) {
    comm.abort(e.what());
    throw DistributedError(fmt::format("{}; communicator aborted; {}", e.what(), comm.who_left()));
  }
}

class NcclWork : public Work {
 public:
  NcclWork(int device, std::shared_ptr<Communicator> comm, Millis timeout, std::string what,
           std::vector<Tensor> keep_alive)
      : device_(device), comm_(std::move(comm)), timeout_(timeout), what_(std::move(what)),
        keep_alive_(std::move(keep_alive)) {
    DeviceGuard guard(Device(DeviceType::cuda, device_));
    MPT_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
  }
  ~NcclWork() override { cudaEventDestroy(done_); }

  cudaEvent_t event() const { return done_; }

  bool is_completed() override {
    std::lock_guard lock(mutex_);
    return completed_ || cudaEventQuery(done_) == cudaSuccess;
  }

  // Polls the event and the communicator's asynchronous error together:
  // a peer that died or a network that broke shows up there, not in the
  // event, which would never complete.
  //
  // While the caller's stream is being captured into a CUDA graph (a whole
  // DDP step, say) nothing runs yet and the host cannot wait: the stream
  // only waits for the collective inside the graph. A replayed collective
  // has no timeout: if a peer dies during a replay, the host's next
  // synchronization waits for it indefinitely.
  void wait() override {
    std::lock_guard lock(mutex_);
    if (completed_) return;
    const std::string earlier = comm_->aborted_because();
    check<DistributedError>(earlier.empty(), "NCCL {}: the communicator was aborted by an earlier failure ({})",
                            what_, earlier);
    const cudaStream_t caller = cuda::current_cuda_stream(device_);
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    MPT_CUDA_CHECK(cudaStreamIsCapturing(caller, &capture));
    if (capture == cudaStreamCaptureStatusActive) {
      MPT_CUDA_CHECK(cudaStreamWaitEvent(caller, done_, 0));
      completed_ = true;
      keep_alive_.clear();  // the graph's own memory pool holds the tensors
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    aborting_on_failure(*comm_, [&] {
      for (;;) {
        const cudaError_t q = cudaEventQuery(done_);
        if (q == cudaSuccess) break;
        if (q != cudaErrorNotReady) MPT_CUDA_CHECK(q);
        ncclResult_t state = ncclSuccess;
        MPT_NCCL_CHECK(ncclCommGetAsyncError(comm_->get(), &state));
        if (state != ncclSuccess && state != ncclInProgress)
          throw DistributedError(
              fmt::format("NCCL {}: {} (a peer failed or the network broke)", what_, ncclGetErrorString(state)));
        const auto waited = std::chrono::duration_cast<Millis>(std::chrono::steady_clock::now() - start);
        if (waited >= timeout_)
          throw TimeoutError(fmt::format("NCCL {}: not finished after {} ms (timeout {} ms; a peer may be dead or "
                                         "stalled)",
                                         what_, waited.count(), timeout_.count()));
        // Collectives of a training step take microseconds: poll without
        // sleeping at first (a 100 us sleep would be most of a small
        // model's step), then back off so a long wait does not burn a core.
        if (waited < Millis(2)) std::this_thread::yield();
        else std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    });
    // Later kernels on the caller's stream see the result.
    MPT_CUDA_CHECK(cudaStreamWaitEvent(caller, done_, 0));
    completed_ = true;
    keep_alive_.clear();
  }

 private:
  int device_;
  std::shared_ptr<Communicator> comm_;
  Millis timeout_;
  std::string what_;
  std::vector<Tensor> keep_alive_;  // the memory stays ours until the GPU is done with it
  cudaEvent_t done_ = nullptr;
  std::mutex mutex_;
  bool completed_ = false;
};

class NcclProcessGroup : public ProcessGroup {
 public:
  NcclProcessGroup(const std::shared_ptr<Store>& store, int rank, int size, int device,
                   const ProcessGroupOptions& options)
      : ProcessGroup(rank, size), device_(device), timeout_(options.timeout),
        comm_(std::make_shared<Communicator>(store, size)) {
    nccl::check_version();
    check_device_available(Device(DeviceType::cuda, device));
    DeviceGuard guard(Device(DeviceType::cuda, device_));
    const int64_t index = store->add(fmt::format("mpt/nccl/groups_of_rank/{}", rank), 1);
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
  }

  ~NcclProcessGroup() override {
    if (ready_) cudaEventDestroy(ready_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  std::string backend_name() const override { return "nccl"; }

  WorkPtr allreduce(const Tensor& t, ReduceOp op) override {
    check_tensor("allreduce", t);
    return launch(fmt::format("allreduce({}) of {}", reduce_op_name(op), describe(t)), {t}, [&](cudaStream_t s) {
      MPT_NCCL_CHECK(ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), nccl::data_type(t.dtype()), nccl::red_op(op),
                                   comm_->get(), s));
    });
  }

  WorkPtr broadcast(const Tensor& t, int root) override {
    check_tensor("broadcast", t);
    check<ValueError>(root >= 0 && root < size(), "broadcast: root {} outside 0..{}", root, size() - 1);
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
    check_tensor("reduce_scatter", output);
    check<ShapeError>(input.numel() == output.numel() * size() && input.dtype() == output.dtype(),
                      "reduce_scatter: input {} must be {} chunks shaped like output {}", describe(input), size(),
                      describe(output));
    return launch(fmt::format("reduce_scatter({}) of {}", reduce_op_name(op), describe(input)), {input, output},
                  [&](cudaStream_t s) {
                    MPT_NCCL_CHECK(ncclReduceScatter(input.data_ptr(), output.data_ptr(), output.numel(),
                                                     nccl::data_type(input.dtype()), nccl::red_op(op), comm_->get(), s));
                  });
  }

  WorkPtr barrier() override {
    Tensor one = Tensor::empty({1}, DType::f32, Device(DeviceType::cuda, device_));
    return launch("barrier", {one}, [&](cudaStream_t s) {
      MPT_NCCL_CHECK(ncclAllReduce(one.data_ptr(), one.data_ptr(), 1, ncclFloat32, ncclSum, comm_->get(), s));
    });
  }

 private:
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
    MPT_CUDA_CHECK(cudaEventRecord(ready_, cuda::current_cuda_stream(device_)));
    MPT_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
    auto work = std::make_shared<NcclWork>(device_, comm_, timeout_, what, std::move(keep_alive));
    aborting_on_failure(*comm_, [&] {
      enqueue(stream_);
      nccl::wait_for({comm_->get()}, timeout_, what);  // a non-blocking comm may still be enqueuing
    });
    if (then) then(stream_);
    MPT_CUDA_CHECK(cudaEventRecord(work->event(), stream_));
    return work;
  }

  int device_;
  Millis timeout_;
  std::shared_ptr<Communicator> comm_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  std::mutex mutex_;
};

}  // namespace

std::shared_ptr<ProcessGroup> new_nccl_process_group(const std::shared_ptr<Store>& store, int rank, int size,
                                                     int device, const ProcessGroupOptions& options) {
  return std::make_shared<NcclProcessGroup>(store, rank, size, device, options);
}

}  // namespace mpt::dist
