#pragma once
// What quantizing a tensor at a scale does to it, for studying FP8 recipes
// (mpt-scaler fp8): its amax, and the fractions of its elements that
// saturate (a scaled magnitude beyond the format's largest finite value,
// clamped to it) and that flush to zero (nonzero, but at most half the
// format's smallest subnormal once scaled, so rounded to 0). NaN elements
// count in neither.
#include "tensor/tensor.h"

namespace mpt::amp {

struct Fp8QuantizationStats {
  double amax = 0;
  double scale = 0;
  double saturated = 0;  // fraction of the elements
  double flushed = 0;    // fraction of the elements
};

// in: f32, f16 or bf16 on any device; scale: f32 [1] beside it; format:
// e4m3 or e5m2. Reads the results back (waits for the device).
Fp8QuantizationStats fp8_quantization_stats(const Tensor& in, const Tensor& scale, DType format);

}  // namespace mpt::amp
