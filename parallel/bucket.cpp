#include "parallel/bucket.h"

#include "tensor/ops.h"

namespace mpt::dist {

std::vector<std::vector<size_t>> assign_buckets(const std::vector<size_t>& order, const std::vector<size_t>& bytes,
                                                size_t first_cap, size_t cap) {
  check<ValueError>(first_cap > 0 && cap > 0, "assign_buckets: bucket caps must be positive (got {} and {})",
                    first_cap, cap);
  std::vector<std::vector<size_t>> buckets;
  std::vector<size_t> current;
  size_t filled = 0;
  auto close = [&] {
    buckets.push_back(std::move(current));
    current.clear();
    filled = 0;
  };
  for (size_t index : order) {
    check<ValueError>(index < bytes.size(), "assign_buckets: parameter index {} outside 0..{}", index,
                      bytes.size() - 1);
    const bool alone = bytes[index] >= cap;
    if (alone && !current.empty()) close();
    current.push_back(index);
    filled += bytes[index];
    if (alone || filled >= (buckets.empty() ? first_cap : cap)) close();
  }
  if (!current.empty()) buckets.push_back(std::move(current));
  return buckets;
}

}  // namespace mpt::dist
