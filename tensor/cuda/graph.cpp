#include "tensor/cuda/graph.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "tensor/cuda/caching_allocator.h"
#include "tensor/cuda/check.h"
#include "tensor/cuda/runtime.h"
#include "tensor/device_guard.h"
#include "tensor/error.h"
#include "tensor/stream.h"

namespace mpt::cuda {

struct Graph::State {
  int device;
  cudaStream_t capture_stream = nullptr;  // capture cannot happen on the legacy default stream
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  int pool = 0;  // the allocator's private pool for the graph's tensors
  // The stream the capture's work follows, and an event recorded there as
  // the capture began: the pool may hold blocks that stream used before.
  cudaStream_t origin = nullptr;
  cudaEvent_t capture_began = nullptr;
  cudaStream_t last_replay_stream = nullptr;
  cudaEvent_t replayed = nullptr;  // recorded after each replay (replays run in launch order)
  std::vector<std::shared_ptr<ReplayWatch>> watches;
};

namespace {
// The watches of the graph whose capture runs on this thread (captures are
// thread-local).
thread_local std::vector<std::shared_ptr<ReplayWatch>>* t_capturing = nullptr;
}  // namespace

void watch_replays(const std::shared_ptr<ReplayWatch>& watch) {
  if (!t_capturing || !watch) return;
  auto& watches = *t_capturing;
  if (std::find(watches.begin(), watches.end(), watch) == watches.end()) watches.push_back(watch);
}

Graph::Graph(int device) : state_(std::make_unique<State>()) {
  state_->device = device;
  DeviceGuard guard(cuda_device(device));
  MPT_CUDA_CHECK(cudaStreamCreateWithFlags(&state_->capture_stream, cudaStreamNonBlocking));
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
    (void)cudaStreamSynchronize(state_->capture_stream);
    if (state_->replayed) (void)cudaEventSynchronize(state_->replayed);
    caching_allocator(state_->device).release_pool(state_->pool, state_->replayed ? state_->last_replay_stream
                                                                                  : state_->origin);
  }
  if (state_->replayed) (void)cudaEventDestroy(state_->replayed);
  if (state_->capture_began) (void)cudaEventDestroy(state_->capture_began);
  (void)cudaStreamDestroy(state_->capture_stream);
  (void)cudaGetLastError();
}

void Graph::capture(const std::function<void()>& work) {
  State& s = *state_;
  check(s.exec == nullptr, "cuda::Graph::capture: this graph already holds a capture");
  const Device device = cuda_device(s.device);
  DeviceGuard guard(device);
  const Stream user = current_stream(device);
  // The graph's work comes after what the caller queued before it.
  s.origin = static_cast<cudaStream_t>(user.handle());
  if (!s.capture_began) MPT_CUDA_CHECK(cudaEventCreateWithFlags(&s.capture_began, cudaEventDisableTiming));
  MPT_CUDA_CHECK(cudaEventRecord(s.capture_began, s.origin));
  MPT_CUDA_CHECK(cudaStreamWaitEvent(s.capture_stream, s.capture_began, 0));
  const Stream capturing(device, s.capture_stream);
  CachingAllocator& allocator = caching_allocator(s.device);
  s.pool = allocator.begin_capture(s.capture_stream, s.origin);
  MPT_CUDA_CHECK(cudaStreamBeginCapture(s.capture_stream, cudaStreamCaptureModeThreadLocal));
  s.watches.clear();
  t_capturing = &s.watches;
  try {
    StreamGuard on_capture_stream(capturing);
    work();
    t_capturing = nullptr;
  } catch (...) {
    t_capturing = nullptr;
    s.watches.clear();
    cudaGraph_t abandoned = nullptr;
    (void)cudaStreamEndCapture(s.capture_stream, &abandoned);
    if (abandoned) (void)cudaGraphDestroy(abandoned);
    (void)cudaGetLastError();
    allocator.end_capture();
    // Nothing captured will run: the pool's blocks go back to the caller's stream.
    allocator.release_pool(s.pool, s.origin);
    s.pool = 0;
    throw;
  }
  const cudaError_t ended = cudaStreamEndCapture(s.capture_stream, &s.graph);
  allocator.end_capture();
  MPT_CUDA_CHECK(ended);
  MPT_CUDA_CHECK(cudaGraphInstantiate(&s.exec, s.graph, 0));
}

void Graph::replay() {
  State& s = *state_;
  check(s.exec != nullptr, "cuda::Graph::replay: nothing was captured");
  DeviceGuard guard(cuda_device(s.device));
  const cudaStream_t stream = current_cuda_stream(s.device);
  for (const auto& w : s.watches) w->before_replay();
  // The pool's blocks taken from the origin's cache: the first replay must
  // follow their earlier users there (later replays follow the first).
  if (!s.replayed && stream != s.origin) MPT_CUDA_CHECK(cudaStreamWaitEvent(stream, s.capture_began, 0));
  MPT_CUDA_CHECK(cudaGraphLaunch(s.exec, stream));
  s.last_replay_stream = stream;
  if (!s.replayed) MPT_CUDA_CHECK(cudaEventCreateWithFlags(&s.replayed, cudaEventDisableTiming));
  MPT_CUDA_CHECK(cudaEventRecord(s.replayed, stream));
  for (const auto& w : s.watches) w->replay_launched(s.device);
}

}  // namespace mpt::cuda
