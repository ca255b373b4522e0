#pragma once
// The GPU's matrix-multiply rate as this process gets it: one square GEMM
// (8192^3, as ../shared/reference/ceilings.py times cuBLAS from PyTorch)
// through mptrain's own matmul, timed with CUDA events. MFU is a step's
// model FLOPs over this rate, measured in the same run.
#include "tensor/device.h"
#include "tensor/dtype.h"

namespace mpt::bench {

// TFLOP/s of the median of `reps` GEMMs after a few warm-up ones.
double gemm_tflops(const Device& device, DType dtype, int64_t n = 8192, int reps = 30);

}  // namespace mpt::bench
