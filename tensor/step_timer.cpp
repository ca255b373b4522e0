#include "tensor/step_timer.h"

namespace mpt {
namespace {
thread_local StepTimer* t_active = nullptr;
}  // namespace

const char* step_phase_name(StepPhase p) {
  switch (p) {
    case StepPhase::data_wait: return "data_wait";
    case StepPhase::forward: return "forward";
    case StepPhase::backward: return "backward";
    case StepPhase::comm: return "comm";
    case StepPhase::optimizer: return "optimizer";
    case StepPhase::graph: return "graph";
    case StepPhase::other: return "other";
  }
  return "?";
}

double StepBreakdown::total_ms() const {
  double t = 0;
  for (double m : ms) t += m;
  return t;
}

void StepBreakdown::add(const StepBreakdown& other) {
  const int64_t n = steps + other.steps;
  if (n == 0) return;
  for (int p = 0; p < kStepPhases; ++p)
    ms[p] = (ms[p] * static_cast<double>(steps) + other.ms[p] * static_cast<double>(other.steps)) / static_cast<double>(n);
  steps = n;
}

StepTimer::StepTimer(const Device& device) : device_(device) {}
StepTimer::~StepTimer() = default;

StepTimer* StepTimer::active() { return t_active; }

StepTimer::Activation::Activation(StepTimer* timer) : previous_(t_active) { t_active = timer; }
StepTimer::Activation::~Activation() { t_active = previous_; }

std::unique_ptr<Event> StepTimer::recycled_event() {
  if (spare_.empty()) return std::make_unique<Event>(device_, /*timing=*/true);
  std::unique_ptr<Event> e = std::move(spare_.back());
  spare_.pop_back();
  return e;
}

void StepTimer::begin_step() {
  if (in_step_) end_step();
  in_step_ = true;
  if (device_.is_cpu()) {
    last_ = std::chrono::steady_clock::now();
    return;
  }
  fold(/*wait=*/false);  // earlier steps the GPU is done with
  current_.clear();
  current_.push_back({-1, recycled_event()});
  current_.back().event->record();
}

void StepTimer::lap(StepPhase phase) {
  if (!in_step_) return;
  if (device_.is_cpu()) {
    const auto now = std::chrono::steady_clock::now();
    sums_[static_cast<int>(phase)] += std::chrono::duration<double, std::milli>(now - last_).count();
    last_ = now;
    return;
  }
  current_.push_back({static_cast<int>(phase), recycled_event()});
  current_.back().event->record();
}

void StepTimer::end_step() {
  if (!in_step_) return;
  in_step_ = false;
  if (device_.is_cpu()) {
    ++steps_;
    return;
  }
  finished_.push_back(std::move(current_));
  current_.clear();
}

void StepTimer::fold(bool wait) {
  while (!finished_.empty()) {
    std::vector<Mark>& marks = finished_.front();
    // Every mark, not only the last: under DataParallel two threads mark,
    // possibly on different streams.
    for (const auto& m : marks) {
      if (wait) m.event->synchronize();
      else if (!m.event->query()) return;
    }
    for (size_t i = 1; i < marks.size(); ++i)
      sums_[marks[i].phase] += marks[i - 1].event->elapsed_ms(*marks[i].event);
    for (auto& m : marks) spare_.push_back(std::move(m.event));
    finished_.pop_front();
    ++steps_;
  }
}

StepBreakdown StepTimer::take() {
  fold(/*wait=*/true);
  StepBreakdown b;
  b.steps = steps_;
  for (int p = 0; p < kStepPhases; ++p) b.ms[p] = steps_ > 0 ? sums_[p] / static_cast<double>(steps_) : 0.0;
  sums_ = {};
  steps_ = 0;
  return b;
}

}  // namespace mpt
