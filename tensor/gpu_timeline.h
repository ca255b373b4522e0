#pragma once
// A step's timeline on the GPU: stamps of the GPU's global timer, written
// by a one-thread kernel at named points of the work (on the stream the
// work runs on), so the spacing of compute and communication can be read
// even inside a replayed CUDA graph, where events cannot be timed and the
// machine may have no timeline profiler. Stamps are taken only while a
// timeline is active on the thread; each costs a launch of a few
// microseconds, so it is a diagnostic (mpt-bench --timeline), not a meter.
//
// begin_step() starts the list over; a graph captured after it writes the
// same slots on every replay, so read() shows the last replay.
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tensor/device.h"

namespace mpt {

class GpuTimeline {
 public:
  explicit GpuTimeline(const Device& device, int capacity = 256);
  ~GpuTimeline();
  GpuTimeline(const GpuTimeline&) = delete;
  GpuTimeline& operator=(const GpuTimeline&) = delete;

  const Device& device() const { return device_; }
  void begin_step();
  // Stamps on `stream` (a cudaStream_t; nullptr: the device's current
  // stream). Stamps past the capacity are dropped.
  void stamp(const std::string& label, void* stream = nullptr);
  // Waits for the GPU, then each stamp's label and its microseconds after
  // the step's first stamp, in the order they were taken.
  std::vector<std::pair<std::string, double>> read() const;

  static GpuTimeline* active();
  class Activation {
   public:
    explicit Activation(GpuTimeline* timeline);
    ~Activation();
    Activation(const Activation&) = delete;
    Activation& operator=(const Activation&) = delete;

   private:
    GpuTimeline* previous_;
  };

 private:
  Device device_;
  int capacity_;
  uint64_t* stamps_ = nullptr;  // device memory, one slot per stamp
  std::vector<std::string> labels_;
};

// Stamps on the active timeline, if any (and if it is on `device`).
// `label` is a string, or a callable that makes one: called only when a
// stamp is taken, so hot paths build no labels while no timeline is active.
template <typename Label>
void gpu_stamp(const Device& device, Label&& label, void* stream = nullptr) {
  GpuTimeline* t = GpuTimeline::active();
  if (!t || t->device() != device) return;
  if constexpr (std::is_invocable_v<Label>) t->stamp(label(), stream);
  else t->stamp(label, stream);
}

}  // namespace mpt
