#pragma once
// Where a training step's time goes: data wait, forward, backward,
// communication not hidden behind backward, optimizer, a replayed CUDA
// graph of the whole step (whose parts cannot be told apart), and the rest
// (counting the loss and right predictions, logging). Each phase boundary is a mark; the time since the
// previous mark goes to the phase named. On a CUDA device a mark is a
// timing event on the current stream, read only once the GPU has passed it
// (a step later, or when the averages are taken), so timing adds no
// synchronisation to the step; on the CPU it is the steady clock.
//
// Code deep inside a step (DDP's wait for its all-reduces) marks through
// StepTimer::active(), the timer of the step running on this thread.
#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "tensor/device.h"
#include "tensor/stream.h"

namespace mpt {

enum class StepPhase { data_wait, forward, backward, comm, optimizer, graph, other };
inline constexpr int kStepPhases = 7;
const char* step_phase_name(StepPhase p);  // "data_wait", "forward", ...

// Mean milliseconds per step of each phase, over `steps` steps.
struct StepBreakdown {
  int64_t steps = 0;
  std::array<double, kStepPhases> ms{};
  double total_ms() const;
  double operator[](StepPhase p) const { return ms[static_cast<int>(p)]; }
  // Merges another breakdown (a weighted mean).
  void add(const StepBreakdown& other);
};

class StepTimer {
 public:
  explicit StepTimer(const Device& device);
  ~StepTimer();
  StepTimer(const StepTimer&) = delete;
  StepTimer& operator=(const StepTimer&) = delete;

  const Device& device() const { return device_; }
  void begin_step();
  void lap(StepPhase phase);  // no-op outside a step
  void end_step();
  // The mean over the steps completed since the last take(). Waits for the
  // GPU to pass the last step's marks: call it at logging intervals.
  StepBreakdown take();

  static StepTimer* active();

  // Makes `timer` this thread's active timer for its lifetime.
  class Activation {
   public:
    explicit Activation(StepTimer* timer);
    ~Activation();
    Activation(const Activation&) = delete;
    Activation& operator=(const Activation&) = delete;

   private:
    StepTimer* previous_;
  };

 private:
  struct Mark {
    int phase;  // -1: the start of the step
    std::unique_ptr<Event> event;
  };
  // Adds the finished steps whose marks the GPU has passed (all of them
  // when `wait`) to the sums.
  void fold(bool wait);
  std::unique_ptr<Event> recycled_event();

  Device device_;
  bool in_step_ = false;
  // CPU: the time of the last mark.
  std::chrono::steady_clock::time_point last_;
  // CUDA: the current step's marks, the finished steps not read yet, spare events.
  std::vector<Mark> current_;
  std::deque<std::vector<Mark>> finished_;
  std::vector<std::unique_ptr<Event>> spare_;
  std::array<double, kStepPhases> sums_{};
  int64_t steps_ = 0;
};

}  // namespace mpt
