#pragma once
// Calls f(T{}) with the C++ type T of a dtype's elements (Half, BFloat16,
// Float8E4M3 and Float8E5M2 for f16, bf16, e4m3 and e5m2): code that handles
// a tensor's memory itself, a collective library's typed call say, picks its
// instantiation with it.
#include <cstdint>

#include "tensor/dtype.h"
#include "tensor/fp8.h"
#include "tensor/half.h"

namespace mpt {

template <typename F>
inline void dispatch_all(DType t, F&& f) {
  switch (t) {
    case DType::f32: return f(float{});
    case DType::f64: return f(double{});
    case DType::f16: return f(Half{});
    case DType::bf16: return f(BFloat16{});
    case DType::i32: return f(int32_t{});
    case DType::i64: return f(int64_t{});
    case DType::u8: return f(uint8_t{});
    case DType::e4m3: return f(Float8E4M3{});
    case DType::e5m2: return f(Float8E5M2{});
  }
}

}  // namespace mpt
