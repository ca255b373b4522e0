#include "tensor/cuda/graph.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "tensor/cuda/caching_allocator.h"
#include "tensor/cuda/check.h"
#include "tensor/cuda/recycled_handles.h"
#include "tensor/cuda/runtime.h"
#include "tensor/device_guard.h"
#include "tensor/error.h"
#include "tensor/stream.h"

namespace mpt::cuda {

struct Graph::State {
  int device;
  cudaStream_t capture_stream = nullptr;  // capture cannot happen on the legacy default stream (see capture_streams)
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  int pool = 0;  // the allocator's private pool for the graph's tensors
  // The stream the capture's work follows (the caller's), and an event
  // recorded there as the capture ended: the pool may hold blocks freed on
  // that stream before, whose last users the first replay must follow.
  cudaStream_t origin = nullptr;
  cudaEvent_t origin_at_capture_end = nullptr;
  cudaStream_t last_replay_stream = nullptr;
  cudaEvent_t replayed = nullptr;  // recorded after each replay (replays run in launch order)
  std::vector<std::shared_ptr<ReplayWatch>> watches;
};

namespace {
// The watches of the graph whose capture runs on this thread (captures are
// thread-local).
thread_local std::vector<std::shared_ptr<ReplayWatch>>* t_capturing = nullptr;

// Capture streams outlive their graphs and serve later ones: what was
// launched inside a capture (an NCCL Work, say) may be dropped after its
// graph and still ask the stream whether it is capturing, and a destroyed
// stream's handle may come back as another stream's. Never destroyed:
// graphs may be destroyed during the process's exit.
RecycledHandles<cudaStream_t>& capture_streams() {
  static auto* streams = new RecycledHandles<cudaStream_t>([] {
    cudaStream_t stream = nullptr;
    MPT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    return stream;
  });
  return *streams;
}
}  // namespace

void watch_replays(const std::shared_ptr<ReplayWatch>& watch) {
  if (!t_capturing || !watch) return;
  auto& watches = *t_capturing;
  if (std::find(watches.begin(), watches.end(), watch) == watches.end()) watches.push_back(watch);
}

Graph::Graph(int device) : state_(std::make_unique<State>()) {
  state_->device = device;
  state_->capture_stream = capture_streams().take(device);
}

Graph::~Graph() {
  // Errors are ignored: a destructor cannot throw (and at exit the driver may be gone).
  if (state_->exec) (void)cudaGraphExecDestroy(state_->exec);
  if (state_->graph) (void)cudaGraphDestroy(state_->graph);
  const bool abandoned = std::any_of(state_->watches.begin(), state_->watches.end(),
                                     [](const auto& w) { return w->replays_abandoned(); });
  // Replays that may never end keep their memory: better leaked than handed
  // to new tensors under kernels that still run.
  if (state_->pool && !abandoned) {
    // Replays still queued may use the pool's memory: let them finish first.
    // An event, not the whole device: another thread may have to enqueue
    // work on this device before they can end (an in-process NCCL peer).
    if (state_->replayed) (void)cudaEventSynchronize(state_->replayed);
    caching_allocator(state_->device).release_pool(state_->pool, state_->replayed ? state_->last_replay_stream
                                                                                  : state_->origin);
  }
  if (state_->replayed) (void)cudaEventDestroy(state_->replayed);
  if (state_->origin_at_capture_end) (void)cudaEventDestroy(state_->origin_at_capture_end);
  // Only captures ran on it, and nothing is queued there eagerly; a failing
  // driver (at exit) keeps it.
  if (cudaStreamQuery(state_->capture_stream) == cudaSuccess)
    capture_streams().give_back(state_->device, state_->capture_stream);
  (void)cudaGetLastError();
}

void Graph::capture(const std::function<void()>& work) {
  State& s = *state_;
  check(s.exec == nullptr, "cuda::Graph::capture: this graph already holds a capture");
  const Device device = cuda_device(s.device);
  DeviceGuard guard(device);
  s.origin = current_cuda_stream(s.device);
  const Stream capturing(device, s.capture_stream);
  CachingAllocator& allocator = caching_allocator(s.device);
  s.pool = allocator.begin_capture(s.capture_stream, s.origin);
  // After a failure nothing captured will run: the pool's blocks go back to
  // the caller's stream, and the graph may be captured again.
  const auto abandon = [&] {
    if (s.graph) (void)cudaGraphDestroy(s.graph);
    s.graph = nullptr;
    (void)cudaGetLastError();
    allocator.release_pool(s.pool, s.origin);
    s.pool = 0;
  };
  if (const cudaError_t began = cudaStreamBeginCapture(s.capture_stream, cudaStreamCaptureModeThreadLocal);
      began != cudaSuccess) {
    allocator.end_capture();
    abandon();
    throw_cuda_error(began, "cudaStreamBeginCapture", __FILE__, __LINE__);
  }
  s.watches.clear();
  t_capturing = &s.watches;
  try {
    StreamGuard on_capture_stream(capturing);
    work();
    t_capturing = nullptr;
  } catch (...) {
    t_capturing = nullptr;
    s.watches.clear();
    (void)cudaStreamEndCapture(s.capture_stream, &s.graph);
    allocator.end_capture();
    abandon();
    throw;
  }
  const cudaError_t ended = cudaStreamEndCapture(s.capture_stream, &s.graph);
  allocator.end_capture();
  try {
    MPT_CUDA_CHECK(ended);
    // Every block the pool took from the origin's cache was freed there
    // before this point, after the work that used it was queued.
    if (!s.origin_at_capture_end)
      MPT_CUDA_CHECK(cudaEventCreateWithFlags(&s.origin_at_capture_end, cudaEventDisableTiming));
    MPT_CUDA_CHECK(cudaEventRecord(s.origin_at_capture_end, s.origin));
    MPT_CUDA_CHECK(cudaGraphInstantiate(&s.exec, s.graph, 0));
  } catch (...) {
    s.watches.clear();
    abandon();
    throw;
  }
}

void Graph::replay() {
  State& s = *state_;
  check(s.exec != nullptr, "cuda::Graph::replay: nothing was captured");
  DeviceGuard guard(cuda_device(s.device));
  const cudaStream_t stream = current_cuda_stream(s.device);
  // Recorded into another graph, the replays would outlive this graph's
  // bookkeeping: its memory goes back to the cache after its own last replay.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  MPT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  check(capture == cudaStreamCaptureStatusNone,
        "cuda::Graph::replay: the current stream of cuda:{} is being captured into another graph; replay this graph "
        "outside that capture",
        s.device);
  for (const auto& w : s.watches) w->before_replay();
  // The pool's blocks taken from the origin's cache: the first replay must
  // follow their earlier users there (later replays follow the first).
  if (!s.replayed && stream != s.origin) MPT_CUDA_CHECK(cudaStreamWaitEvent(stream, s.origin_at_capture_end, 0));
  MPT_CUDA_CHECK(cudaGraphLaunch(s.exec, stream));
  s.last_replay_stream = stream;
  if (!s.replayed) MPT_CUDA_CHECK(cudaEventCreateWithFlags(&s.replayed, cudaEventDisableTiming));
  MPT_CUDA_CHECK(cudaEventRecord(s.replayed, stream));
  for (const auto& w : s.watches) w->replay_launched(s.device);
}

}  // namespace mpt::cuda
