#include "tensor/dtype.h"

#include "tensor/error.h"

namespace mpt {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f16: return 2;
    case DType::bf16: return 2;
    case DType::f64: return 8;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u8: return 1;
    case DType::e4m3: return 1;
    case DType::e5m2: return 1;
  }
  throw DTypeError("dtype_size: unknown dtype");
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::f64: return "f64";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
    case DType::e4m3: return "e4m3";
    case DType::e5m2: return "e5m2";
  }
  return "?";
}

DType dtype_from_name(const std::string& n) {
  if (n == "f32" || n == "float32" || n == "fp32" || n == "float") return DType::f32;
  if (n == "f16" || n == "float16" || n == "fp16" || n == "half") return DType::f16;
  if (n == "bf16" || n == "bfloat16") return DType::bf16;
  if (n == "f64" || n == "float64" || n == "fp64" || n == "double") return DType::f64;
  if (n == "i32" || n == "int32") return DType::i32;
  if (n == "i64" || n == "int64") return DType::i64;
  if (n == "u8" || n == "uint8") return DType::u8;
  if (n == "e4m3" || n == "float8_e4m3fn") return DType::e4m3;
  if (n == "e5m2" || n == "float8_e5m2") return DType::e5m2;
  throw DTypeError(fmt::format("unknown dtype '{}' (expected f32, f16, bf16, f64, i32, i64, u8, e4m3 or e5m2)", n));
}

bool is_floating(DType t) {
  return t == DType::f32 || t == DType::f16 || t == DType::bf16 || t == DType::f64 || is_float8(t);
}

bool is_float8(DType t) { return t == DType::e4m3 || t == DType::e5m2; }

DType compute_dtype(DType t) { return t == DType::f64 ? DType::f64 : DType::f32; }

namespace {
int float_rank(DType t) {
  switch (t) {
    case DType::f16: return 1;
    case DType::bf16: return 1;
    case DType::f32: return 2;
    case DType::f64: return 3;
    default: return 0;
  }
}
int int_rank(DType t) {
  switch (t) {
    case DType::u8: return 1;
    case DType::i32: return 2;
    case DType::i64: return 3;
    default: return 0;
  }
}
}  // namespace

DType promote(DType a, DType b) {
  if (a == b) return a;
  if (is_float8(a) || is_float8(b))
    throw DTypeError(fmt::format("promote: {} and {} have no common dtype: float8 promotes with nothing but itself; "
                                 "cast with to() first",
                                 dtype_name(a), dtype_name(b)));
  bool fa = is_floating(a), fb = is_floating(b);
  if (fa && !fb) return a;
  if (fb && !fa) return b;
  if (fa && fb) {
    if (float_rank(a) == 1 && float_rank(b) == 1) return DType::f32;  // f16 with bf16
    return float_rank(a) >= float_rank(b) ? a : b;
  }
  return int_rank(a) >= int_rank(b) ? a : b;
}

}  // namespace mpt
