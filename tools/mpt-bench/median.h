#pragma once
// The median of a run's timings (the figure mpt-bench reports, as
// torch_bench.py does).
#include <algorithm>
#include <vector>

namespace mpt::bench {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace mpt::bench
