// Reductions over the middle axis of a contiguous [outer, k, inner] block.
// Floating inputs accumulate in f32 (f64 for f64), like the GPU kernels.
// Every output is computed by one thread in an order fixed by the shape
// alone, so the split over threads never changes a bit.
#include <algorithm>
#include <vector>

#include "tensor/cpu/cpu_kernels.h"
#include "tensor/cpu/cpu_threads.h"

namespace mpt::cpu {
namespace {

template <ReduceOp Op, typename C>
bool replaces(C candidate, C current) {
  if constexpr (Op == ReduceOp::min) return beats_min(candidate, current);
  else return beats_max(candidate, current);
}

// Long sums go in blocks: each block's terms added in the compute type,
// the blocks' sums in double. An f32 total that takes millions of terms one
// after another drifts (a running 5e4 rounds each added 0.01 to a multiple
// of 0.0039: 4% off over 4e7 terms); this way the error is a block's. Sums
// of up to a block are as before.
constexpr int64_t kRunBlock = 2048;    // along a contiguous run: 256 terms per lane
constexpr int64_t kColumnBlock = 256;  // down a column: one accumulator

// A sum of one contiguous run of at most kRunBlock in eight interleaved
// partial sums: the loop vectorizes, and the result depends only on the
// run's length.
template <typename T, typename C>
C sum_lanes(const T* x, int64_t k) {
  constexpr int64_t kLanes = 8;
  C lane[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= k; j += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lane[l] += load<T, C>(x + j + l);
  for (int64_t l = 0; j < k; ++j, ++l) lane[l] += load<T, C>(x + j);
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

template <typename T, typename C>
C sum_run(const T* x, int64_t k) {
  if (k <= kRunBlock) return sum_lanes<T, C>(x, k);
  double total = 0;
  for (int64_t j = 0; j < k; j += kRunBlock)
    total += static_cast<double>(sum_lanes<T, C>(x + j, std::min(kRunBlock, k - j)));
  return static_cast<C>(total);
}

template <typename T, ReduceOp Op>
struct Reduction {
  using C = typename ComputeType<T>::type;
  const T* x;
  void* out;
  int64_t k, inner;

  void store_result(int64_t at, C value, int64_t index) const {
    if constexpr (Op == ReduceOp::argmax) static_cast<int64_t*>(out)[at] = index;
    else if constexpr (Op == ReduceOp::mean) store<T, C>(static_cast<T*>(out) + at, value * (C{1} / static_cast<C>(k)));
    else store<T, C>(static_cast<T*>(out) + at, value);
  }

  // inner == 1: each output is one contiguous run of k.
  void runs(int64_t first, int64_t last) const {
    for (int64_t o = first; o < last; ++o) {
      const T* run = x + o * k;
      if constexpr (Op == ReduceOp::sum || Op == ReduceOp::mean) {
        store_result(o, sum_run<T, C>(run, k), 0);
      } else {
        C best = load<T, C>(run);
        int64_t at = 0;
        for (int64_t j = 1; j < k; ++j) {
          const C v = load<T, C>(run + j);
          if (replaces<Op>(v, best)) {
            best = v;
            at = j;
          }
        }
        store_result(o, best, at);
      }
    }
  }

  // Columns [first, last) of blocks [o_first, o_last), walking k in the
  // outer loop so that the reads along `inner` stay contiguous.
  void columns(int64_t o_first, int64_t o_last, int64_t first, int64_t last) const {
    if constexpr (Op == ReduceOp::sum || Op == ReduceOp::mean) {
      column_sums(o_first, o_last, first, last);
      return;
    }
    const int64_t width = last - first;
    std::vector<C> acc(static_cast<size_t>(width));
    std::vector<int64_t> arg(Op == ReduceOp::argmax ? static_cast<size_t>(width) : 0);
    for (int64_t o = o_first; o < o_last; ++o) {
      const T* block = x + o * k * inner + first;
      for (int64_t i = 0; i < width; ++i) acc[i] = load<T, C>(block + i);
      std::fill(arg.begin(), arg.end(), 0);
      for (int64_t j = 1; j < k; ++j) {
        const T* row = block + j * inner;
        for (int64_t i = 0; i < width; ++i) {
          const C v = load<T, C>(row + i);
          if (replaces<Op>(v, acc[i])) {
            acc[i] = v;
            if constexpr (Op == ReduceOp::argmax) arg[i] = j;
          }
        }
      }
      for (int64_t i = 0; i < width; ++i)
        store_result(o * inner + first + i, acc[i], Op == ReduceOp::argmax ? arg[i] : 0);
    }
  }

  // columns() for sums: kColumnBlock rows at a time in the compute type,
  // the blocks' sums in double (see kRunBlock).
  void column_sums(int64_t o_first, int64_t o_last, int64_t first, int64_t last) const {
    const int64_t width = last - first;
    std::vector<C> acc(static_cast<size_t>(width));
    std::vector<double> total(static_cast<size_t>(width));
    for (int64_t o = o_first; o < o_last; ++o) {
      const T* block = x + o * k * inner + first;
      std::fill(total.begin(), total.end(), 0.0);
      for (int64_t j0 = 0; j0 < k; j0 += kColumnBlock) {
        const int64_t j1 = std::min(k, j0 + kColumnBlock);
        for (int64_t i = 0; i < width; ++i) acc[i] = load<T, C>(block + j0 * inner + i);
        for (int64_t j = j0 + 1; j < j1; ++j) {
          const T* row = block + j * inner;
          for (int64_t i = 0; i < width; ++i) acc[i] += load<T, C>(row + i);
        }
        for (int64_t i = 0; i < width; ++i) total[i] += static_cast<double>(acc[i]);
      }
      for (int64_t i = 0; i < width; ++i) store_result(o * inner + first + i, static_cast<C>(total[i]), 0);
    }
  }
};

template <typename T, ReduceOp Op>
void reduce_typed(const TensorView& out, const TensorView& in, int64_t outer, int64_t k, int64_t inner) {
  const Reduction<T, Op> r{static_cast<const T*>(in.data), out.data, k, inner};
  if (inner == 1) {
    parallel_for(outer, 1, units_for_work(kMinElementsPerPiece, k), [&](int64_t b, int64_t e) { r.runs(b, e); });
  } else if (outer >= cpu_threads()) {
    parallel_for(outer, 1, units_for_work(kMinElementsPerPiece, k * inner),
                 [&](int64_t b, int64_t e) { r.columns(b, e, 0, inner); });
  } else {
    // Too few blocks to go round: split the columns, 16 at a time.
    parallel_for(inner, 16, units_for_work(kMinElementsPerPiece, 16 * outer * k),
                 [&](int64_t b, int64_t e) { r.columns(0, outer, b, e); });
  }
}

template <typename T>
void reduce_dispatch(ReduceOp op, const TensorView& out, const TensorView& in, int64_t outer, int64_t k,
                     int64_t inner) {
  switch (op) {
    case ReduceOp::sum: return reduce_typed<T, ReduceOp::sum>(out, in, outer, k, inner);
    case ReduceOp::mean: return reduce_typed<T, ReduceOp::mean>(out, in, outer, k, inner);
    case ReduceOp::max: return reduce_typed<T, ReduceOp::max>(out, in, outer, k, inner);
    case ReduceOp::min: return reduce_typed<T, ReduceOp::min>(out, in, outer, k, inner);
    case ReduceOp::argmax: return reduce_typed<T, ReduceOp::argmax>(out, in, outer, k, inner);
  }
}

}  // namespace

void reduce(ReduceOp op, const TensorView& out, const TensorView& in, int64_t outer, int64_t k, int64_t inner) {
  dispatch_float(in.dtype, reduce_op_name(op),
                 [&](auto tag) { reduce_dispatch<decltype(tag)>(op, out, in, outer, k, inner); });
}

}  // namespace mpt::cpu
