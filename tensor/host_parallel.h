#pragma once
// Loops over host memory split over the CPU backend's threads, for the
// layers above tensor/ that run such loops themselves (the fused
// optimizers' host path): the same pieces and pool as the backend's own
// element-wise kernels, so the two never compete for the CPUs.
#include <cstdint>
#include <functional>

namespace mpt {

// f(begin, end) over [0, n) elements, in pieces of whole cache lines worth
// handing to a thread (on the calling thread alone where n is small).
// Returns when all are done; rethrows the first piece's exception.
void parallel_for_host_elements(int64_t n, const std::function<void(int64_t begin, int64_t end)>& f);

}  // namespace mpt
