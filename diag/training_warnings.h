#pragma once
// Warnings a training run gives about itself: a device idling while the
// others work (its rank waits, usually for data), and a rank whose steps
// take much longer than the others' (a slower GPU, a busier host, uneven
// data). Pure functions of what was measured, so they are tested alone.
#include <optional>
#include <string>
#include <vector>

namespace mpt::diag {

// Fed one utilisation sample per device (percent) about once a second.
// Warns once when a device has been idle (<= idle_percent) for `samples`
// readings in a row while another was busy (>= busy_percent); again only
// after that device has worked in between.
class IdleDetector {
 public:
  explicit IdleDetector(std::vector<std::string> names, int samples = 3, unsigned idle_percent = 10,
                        unsigned busy_percent = 50);
  std::optional<std::string> update(const std::vector<unsigned>& utilization);

 private:
  std::vector<std::string> names_;
  int samples_;
  unsigned idle_percent_, busy_percent_;
  std::vector<int> idle_run_;
  std::vector<bool> warned_;
};

// Each rank's mean time per step spent working (the step without its
// communication wait: the ranks wait for each other there, which makes
// whole step times equal). A warning when the slowest rank works more than
// `ratio` times as long as the median of the others, and at least
// `min_ms` longer.
std::optional<std::string> imbalance_warning(const std::vector<double>& work_ms_per_rank, double ratio = 1.3,
                                             double min_ms = 1.0);

}  // namespace mpt::diag
