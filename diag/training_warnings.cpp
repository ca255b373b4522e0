#include "diag/training_warnings.h"

#include <algorithm>

#include <fmt/format.h>

namespace mpt::diag {

IdleDetector::IdleDetector(std::vector<std::string> names, int samples, unsigned idle_percent,
                           unsigned busy_percent)
    : names_(std::move(names)),
      samples_(samples),
      idle_percent_(idle_percent),
      busy_percent_(busy_percent),
      idle_run_(names_.size(), 0),
      warned_(names_.size(), false) {}

std::optional<std::string> IdleDetector::update(const std::vector<unsigned>& utilization) {
  std::optional<std::string> warning;
  const size_t n = std::min(utilization.size(), names_.size());
  for (size_t i = 0; i < n; ++i) {
    size_t busiest = i;
    for (size_t j = 0; j < n; ++j)
      if (j != i && (busiest == i || utilization[j] > utilization[busiest])) busiest = j;
    const bool others_busy = busiest != i && utilization[busiest] >= busy_percent_;
    if (utilization[i] <= idle_percent_ && others_busy) {
      ++idle_run_[i];
    } else {
      if (utilization[i] > idle_percent_) warned_[i] = false;  // it worked again: a new episode may warn
      idle_run_[i] = 0;
    }
    if (idle_run_[i] >= samples_ && !warned_[i] && !warning) {
      warned_[i] = true;
      warning = fmt::format(
          "warning: {} has been idle ({}%) for {} samples while {} is {}% busy: its work is not arriving (a data "
          "loader stall? try more --workers) or its rank waits for another",
          names_[i], utilization[i], idle_run_[i], names_[busiest], utilization[busiest]);
    }
  }
  return warning;
}

std::optional<std::string> imbalance_warning(const std::vector<double>& work_ms_per_rank, double ratio,
                                             double min_ms) {
  if (work_ms_per_rank.size() < 2) return std::nullopt;
  const auto slowest = std::max_element(work_ms_per_rank.begin(), work_ms_per_rank.end());
  std::vector<double> others;
  for (auto it = work_ms_per_rank.begin(); it != work_ms_per_rank.end(); ++it)
    if (it != slowest) others.push_back(*it);
  std::sort(others.begin(), others.end());
  const size_t m = others.size();
  const double median = m % 2 ? others[m / 2] : (others[m / 2 - 1] + others[m / 2]) / 2;
  if (*slowest < median * ratio || *slowest - median < min_ms) return std::nullopt;
  return fmt::format(
      "warning: rank {} works {:.1f} ms per step, the other ranks {:.1f} ms (median): the others wait for it every "
      "step (a slower or shared GPU, a busier host, or uneven data)",
      slowest - work_ms_per_rank.begin(), *slowest, median);
}

}  // namespace mpt::diag
