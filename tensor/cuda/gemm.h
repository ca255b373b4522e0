#pragma once
// Matrix products on CUDA through cuBLASLt. Included by CPU-only builds too
// (the stubs and the settings), so it names no CUDA type: the cuBLASLt
// internals the GEMM files share are in lt_common.h.
#include "tensor/backend.h"

namespace mpt::cuda {

// Whether f32 matmuls issued by this thread may run on TF32 tensor cores
// (inputs rounded to 10 mantissa bits). Off by default: f32 means f32.
void set_allow_tf32(bool allow);
bool allow_tf32();

// args.out = alpha * a @ b + beta * args.out (see GemmArgs) on the current
// device's current stream. f32, f64, and f16/bf16 with f32 accumulation.
void gemm(const GemmArgs& args);

// Fp8GemmArgs as tensor/backend.h says (checked by the caller); throws
// DeviceError on a GPU older than compute capability 8.9.
void gemm_fp8(const Fp8GemmArgs& args);

}  // namespace mpt::cuda
