#pragma once
// One CUDA graph: the work a function enqueues on a device's current stream,
// recorded once (with its own memory pool in the caching allocator) and
// launched again as a single unit. No CUDA headers here, so portable code
// (tensor/graph.cpp) can hold one; a CPU-only build's stub throws.
#include <functional>
#include <memory>
#include <vector>

namespace mpt::cuda {

// Work inside a graph that the host must keep an eye on at each replay: a
// collective waits forever on the GPU for a peer that died, and no host
// call of the replayed step is there to time out. Registered while the
// graph is captured (watch_replays), kept as long as the graph.
class ReplayWatch {
 public:
  virtual ~ReplayWatch() = default;
  // Before each launch; it may wait (for an earlier replay to end), and
  // throwing stops the launch (an earlier replay failed).
  virtual void before_replay() = 0;
  // After each launch on `device`'s current stream.
  virtual void replay_launched(int device) = 0;
  // True once the watch gave up on the replays (a peer died): they may
  // never end, so the graph neither waits for them nor frees their memory.
  virtual bool replays_abandoned() const = 0;
};

// Called by code running inside Graph::capture on the capturing thread: the
// graph calls `watch` around each of its replays (once, however often it is
// registered). Outside a capture it does nothing: eager work is waited for
// by whoever enqueued it.
void watch_replays(const std::shared_ptr<ReplayWatch>& watch);

class Graph {
 public:
  explicit Graph(int device);
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  // Runs `work` with the device's current stream capturing: its kernels are
  // recorded, not executed. Work already queued on that stream is ordered
  // before the graph. When `work` throws, or does something a capture
  // forbids (a host synchronization, say), the capture is abandoned and
  // CudaError/the exception propagates; the graph stays empty.
  void capture(const std::function<void()>& work);
  // Launches the captured work on the device's current stream, between the
  // calls of the ReplayWatches registered during the capture. Refused
  // (Error) while that stream is being captured into another graph, whose
  // replays this graph's memory could not follow.
  void replay();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace mpt::cuda
