#pragma once
// Internal: FP8 quantization and amax kernels (tensor/cuda/fp8_quantize.cu).
#include "tensor/backend.h"
#include "tensor/cuda/kernels.h"

namespace mpt::cuda {

// Fp8QuantizeArgs as tensor/backend.h says (checked by the caller), with
// `scratch` device memory of quantize_fp8_scratch_bytes(q).
size_t quantize_fp8_scratch_bytes(const Fp8QuantizeArgs& q);
void launch_quantize_fp8(const Launch& l, const Fp8QuantizeArgs& q, void* scratch);
void launch_amax_into(const Launch& l, const TensorView& amax, const TensorView& in);

}  // namespace mpt::cuda
