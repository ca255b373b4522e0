#pragma once
// Named ranges on the profiler timeline (NVTX, shown by Nsight Systems):
// a training step marks its forward, backward, communication and optimizer
// phases. NVTX3 is header-only and costs a few nanoseconds when no profiler
// is attached; in a build without CUDA these calls do nothing.
namespace mpt {

void nvtx_push(const char* name);
void nvtx_pop();

// Pushes `name` for the life of the object.
class NvtxRange {
 public:
  explicit NvtxRange(const char* name) { nvtx_push(name); }
  ~NvtxRange() { nvtx_pop(); }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace mpt
