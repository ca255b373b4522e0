#pragma once
// One CUDA graph: the work a function enqueues on a device's current stream,
// recorded once (with its own memory pool in the caching allocator) and
// launched again as a single unit. No CUDA headers here, so portable code
// (tensor/graph.cpp) can hold one; a CPU-only build's stub throws.
#include <functional>
#include <memory>

namespace mpt::cuda {

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
  // Launches the captured work on the device's current stream.
  void replay();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace mpt::cuda
