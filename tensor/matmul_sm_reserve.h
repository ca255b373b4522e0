#pragma once
// SMs that this thread's GPU matmuls leave free for kernels running beside
// them: the collectives that overlap backward in data parallelism.
//
// A collective's kernel holds its SMs for as long as it runs. A GEMM that
// cuBLASLt planned for every SM of the device then cannot place its last
// tiles until the collective ends, so the two run one after the other and
// the overlap buys nothing. Planned for the SMs left over
// (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET), the GEMM runs beside it, a little
// slower than alone. The CPU backend ignores the reserve.
#include <cstdint>

namespace mpt {

struct MatmulSmReserve {
  int sms = 0;           // SMs to leave free; 0: matmuls plan for the whole device
  int64_t matmuls = -1;  // how many more matmuls it applies to; -1: until it is changed
};

// This thread's reserve (thread-local: each device thread of a replica group
// overlaps its own collectives).
void set_matmul_sm_reserve(MatmulSmReserve reserve);
MatmulSmReserve matmul_sm_reserve();

// For the backends: the SMs the next matmul leaves free, counting it against
// the reserve's `matmuls`.
int take_matmul_sm_reserve();

}  // namespace mpt
