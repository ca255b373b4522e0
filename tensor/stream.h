#pragma once
// Streams and events. Every kernel runs on the current stream of its device.
// On the CPU work is synchronous: the CPU stream is a placeholder and its
// calls do nothing. Library-created CUDA streams live as long as the process
// (as in PyTorch), so a Stream handle never dangles.
#include <memory>

#include "tensor/device.h"

namespace mpt {

class Stream {
 public:
  Stream() = default;  // the CPU stream
  Stream(Device device, void* handle) : device_(device), handle_(handle) {}

  // A new non-blocking CUDA stream on `device` (higher priority = lower number, as CUDA counts).
  static Stream create(const Device& device, int priority = 0);
  // The legacy default stream of `device`.
  static Stream default_stream(const Device& device) { return Stream(device, nullptr); }

  const Device& device() const { return device_; }
  void* handle() const { return handle_; }  // cudaStream_t
  void synchronize() const;
  friend bool operator==(const Stream& a, const Stream& b) {
    return a.device_ == b.device_ && a.handle_ == b.handle_;
  }

 private:
  Device device_ = kCPU;
  void* handle_ = nullptr;
};

// This thread's current stream on `device` (the default stream until set).
Stream current_stream(const Device& device);
void set_current_stream(const Stream& s);
// Waits until all work queued on `device` is done.
void synchronize(const Device& device);

// Makes `s` current for its device within a scope.
class StreamGuard {
 public:
  explicit StreamGuard(const Stream& s) : previous_(current_stream(s.device())) { set_current_stream(s); }
  ~StreamGuard() { set_current_stream(previous_); }
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  Stream previous_;
};

// A CUDA event (a marker in a stream). Timing events measure elapsed time
// between two records.
class Event {
 public:
  explicit Event(const Device& device, bool timing = false);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record(const Stream& s);
  void record() { record(current_stream(device_)); }
  // As record(), but while `s` is being captured into a CUDA graph the
  // record becomes a node of the graph that every replay performs, so other
  // streams can wait for that point of a replay (a plain record there only
  // orders the streams of the capture).
  void record_external(const Stream& s);
  void wait(const Stream& s) const;  // `s` waits for this event, without blocking the host
  void synchronize() const;          // the host waits
  bool query() const;                // done?
  float elapsed_ms(const Event& end) const;

 private:
  Device device_;
  [[maybe_unused]] void* handle_ = nullptr;  // cudaEvent_t (unread in a build without CUDA)
};

}  // namespace mpt
