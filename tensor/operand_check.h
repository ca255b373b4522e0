#pragma once
// Checks that the raw ops share on their operands. Each message names the op
// and describes the operands (dtype, shape, device), so a caller sees which
// call failed and why without a debugger.
#include "tensor/error.h"
#include "tensor/tensor.h"

namespace mpt {

inline void check_same_device(const char* op, const Tensor& a, const Tensor& b) {
  check<DeviceError>(a.device() == b.device(), "{}: operands are on different devices: {} and {}", op, describe(a),
                     describe(b));
}

inline void check_same_device_and_dtype(const char* op, const Tensor& a, const Tensor& b) {
  check_same_device(op, a, b);
  check<DTypeError>(a.dtype() == b.dtype(), "{}: operands differ in dtype: {} and {}", op, describe(a), describe(b));
}

inline void check_floating(const char* op, const Tensor& t) {
  check<DTypeError>(is_floating(t.dtype()), "{}: expected a floating tensor (f32, f16, bf16, f64), got {}", op,
                    describe(t));
}

}  // namespace mpt
