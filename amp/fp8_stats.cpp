#include "amp/fp8_stats.h"

#include <cmath>

#include "amp/fp8_scale_rule.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace mpt::amp {

Fp8QuantizationStats fp8_quantization_stats(const Tensor& in, const Tensor& scale, DType format) {
  check<DTypeError>(is_float8(format), "fp8_quantization_stats: format must be e4m3 or e5m2, got {}",
                    dtype_name(format));
  const bool e4m3 = format == DType::e4m3;
  const double max_finite = e4m3 ? kE4m3Max : kE5m2Max;
  const double half_smallest = std::ldexp(1.0, e4m3 ? -10 : -17);  // half of 2^-9, 2^-16
  const Device device = in.device();
  const Tensor magnitude = prim::mul(prim::unary(UnaryOp::abs, prim::to(in, DType::f32), 0.0, 0.0), scale);
  auto fraction = [&](const Tensor& mask) {
    return in.numel() == 0 ? 0.0 : prim::sum(mask).item() / static_cast<double>(in.numel());
  };
  Fp8QuantizationStats s;
  s.scale = scale.item();
  s.amax = in.numel() == 0 ? 0.0 : prim::amax(prim::unary(UnaryOp::abs, prim::to(in, DType::f32), 0.0, 0.0)).item();
  s.saturated = fraction(prim::binary(BinaryOp::gt, magnitude, full({1}, max_finite, DType::f32, device)));
  s.flushed = fraction(prim::mul(prim::binary(BinaryOp::gt, magnitude, zeros({1}, DType::f32, device)),
                                 prim::binary(BinaryOp::le, magnitude, full({1}, half_smallest, DType::f32, device))));
  return s;
}

}  // namespace mpt::amp
