#pragma once
// The index check kernel's interface, free of the tensor headers so the
// kernel file compiles without them.
#include <cstdint>

namespace mpt::cuda {

// The slot a failed index check fills (host-mapped memory; index_check.cpp).
struct IndexCheckFailure {
  int failed;  // 0, or 1 once a kernel has claimed the slot
  int op;      // the checking op's id
  long long index, bound, ignore;
  int has_ignore;
};
// Records in *slot the first index of idx[0..n) (i64 or i32) outside
// [0, bound) that is not `ignore` (when has_ignore).
void launch_index_check(void* stream, IndexCheckFailure* slot, const void* idx, bool i64, int64_t n,
                        int64_t bound, bool has_ignore, int64_t ignore, int op);

}  // namespace mpt::cuda
