#pragma once
// One long-lived thread per device, for the single-process data-parallel
// classes (DataParallel, ReplicaGroup). run(fn) calls fn(i) on device i's
// thread for every i at once, with device i current and the caller's grad
// mode, autocast settings and TF32 setting (all per thread; when the caller
// is in an autocast region, fn runs in one whose weight casts live until fn
// returns) and a fork of the caller's default generator, and returns once every call has finished; the error raised
// first is rethrown only then, since the calls may use the caller's frame.
//
// On a CUDA device each thread enqueues on a stream of its own (the legacy
// default stream is one per device for all threads: a thread copying from
// another device would chain its work behind that device's), ordered after
// what the caller queued on the device before run() and before what it
// queues after.
#include <functional>
#include <memory>
#include <vector>

#include "parallel/work_queue.h"
#include "tensor/device.h"
#include "tensor/stream.h"

namespace mpt::dist {

class DeviceThreads {
 public:
  explicit DeviceThreads(std::vector<Device> devices);
  ~DeviceThreads();
  DeviceThreads(const DeviceThreads&) = delete;
  DeviceThreads& operator=(const DeviceThreads&) = delete;

  void run(const std::function<void(size_t index)>& fn);
  size_t size() const { return devices_.size(); }

 private:
  std::vector<Device> devices_;
  std::vector<Stream> streams_;  // per device: its thread's stream
  std::vector<std::unique_ptr<WorkQueue>> workers_;
};

}  // namespace mpt::dist
