#pragma once
// The threads the CPU backend splits large work over. The count is the
// number of CPUs this process may run on (its affinity mask), or
// MPT_CPU_THREADS where that is set; it is read once per process, so a
// kernel that splits by it gives the same bits in every run on the same
// machine.
#include <algorithm>
#include <cstdint>
#include <functional>

namespace mpt::cpu {

// Multiply-adds worth handing to another thread (products, convolutions).
constexpr int64_t kMinMultiplyAddsPerPiece = int64_t{1} << 22;

// How many units of `work_per_unit` make at least `min_work`: a
// parallel_for's `min_grains_per_piece` from the work of one grain.
inline int64_t units_for_work(int64_t min_work, int64_t work_per_unit) {
  const int64_t unit = std::max<int64_t>(work_per_unit, 1);
  return (min_work + unit - 1) / unit;
}

// At least 1. ValueError (naming the variable) for an MPT_CPU_THREADS that
// is not a whole number from 1 to 1024.
int cpu_threads();

// The CPUs this process may run on (at least 1): a container or `taskset`
// narrows them, which std::thread::hardware_concurrency() does not see.
// cpu_threads() without MPT_CPU_THREADS; mpt-run shares them among ranks.
int usable_cpus();

// f(begin, end) over [0, count) in up to cpu_threads() contiguous pieces,
// each a whole number of `grain`s (but the last) and worth at least
// `min_grains_per_piece` grains, run by the calling thread and a pool of
// cpu_threads() - 1 workers (made at the first split, kept for the
// process). The pieces depend only on the arguments and cpu_threads().
// While the pool serves another caller (a nested split, say), the calling
// thread runs all of its pieces itself. Returns when all are done;
// rethrows the first piece's exception.
void parallel_for(int64_t count, int64_t grain, int64_t min_grains_per_piece,
                  const std::function<void(int64_t begin, int64_t end)>& f);

// Element-wise work of at least this many elements a piece is split over
// the threads: below it the handoff costs more than the loop.
constexpr int64_t kMinElementsPerPiece = int64_t{1} << 16;
constexpr int64_t kElementGrain = 1024;  // pieces of whole cache lines

// f(begin, end) over [0, n) elements of dense operands, in pieces as above
// (on the calling thread alone where n is too small to split).
template <typename F>
void parallel_for_elements(int64_t n, F&& f) {
  if (n < 2 * kMinElementsPerPiece) return f(int64_t{0}, n);
  parallel_for(n, kElementGrain, kMinElementsPerPiece / kElementGrain, f);
}

}  // namespace mpt::cpu
