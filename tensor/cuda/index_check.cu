// The index check kernel of index_check.cpp.
#include "tensor/cuda/kernel_utils.cuh"
#include "tensor/cuda/index_check_kernel.h"

namespace mpt::cuda {
namespace {

template <typename I>
__global__ void index_check_kernel(IndexCheckFailure* slot, const I* __restrict__ idx, int64_t n, int64_t bound,
                                   bool has_ignore, int64_t ignore, int op) {
  for (int64_t i = global_thread(); i < n; i += grid_threads()) {
    const int64_t v = static_cast<int64_t>(idx[i]);
    if ((has_ignore && v == ignore) || (v >= 0 && v < bound)) continue;
    // The first failing thread fills the slot; the host reads it after a sync.
    if (atomicCAS(&slot->failed, 0, 1) == 0) {
      slot->op = op;
      slot->index = v;
      slot->bound = bound;
      slot->ignore = ignore;
      slot->has_ignore = has_ignore;
      __threadfence_system();
    }
    return;
  }
}

}  // namespace

void launch_index_check(void* stream_handle, IndexCheckFailure* slot, const void* idx, bool i64, int64_t n,
                        int64_t bound, bool has_ignore, int64_t ignore, int op) {
  const auto stream = static_cast<cudaStream_t>(stream_handle);
  const unsigned blocks = static_cast<unsigned>((n + 255) / 256 < 1024 ? (n + 255) / 256 : 1024);
  if (i64)
    index_check_kernel<<<blocks, 256, 0, stream>>>(slot, static_cast<const int64_t*>(idx), n, bound, has_ignore,
                                                   ignore, op);
  else
    index_check_kernel<<<blocks, 256, 0, stream>>>(slot, static_cast<const int32_t*>(idx), n, bound, has_ignore,
                                                   ignore, op);
  MPT_CUDA_CHECK_LAUNCH("index_check_kernel");
}

}  // namespace mpt::cuda
