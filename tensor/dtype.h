#pragma once
// Element types. f16 and bf16 are real storage types on every device; the CPU
// converts with IEEE round-to-nearest-even exactly as the GPU does. e4m3 and
// e5m2 (float8, tensor/fp8.h) are storage too, but only for casts and data
// movement, as in PyTorch: arithmetic on them is refused.
#include <cstddef>
#include <cstdint>
#include <string>

namespace mpt {

enum class DType : uint8_t { f32, f16, bf16, f64, i32, i64, u8, e4m3, e5m2 };

inline constexpr DType kAllDTypes[] = {DType::f32, DType::f16, DType::bf16, DType::f64, DType::i32,
                                       DType::i64, DType::u8,  DType::e4m3, DType::e5m2};

size_t dtype_size(DType t);
const char* dtype_name(DType t);
DType dtype_from_name(const std::string& name);  // "f32", "float16", "bf16", "float8_e4m3fn", ...
// Floating, float8 included (torch.is_floating_point): a gate for
// arithmetic is operand_check.h's check_floating, which refuses float8.
bool is_floating(DType t);
bool is_float8(DType t);  // e4m3, e5m2
// The wider of two dtypes, as PyTorch promotes: floats win over integers,
// f16 with bf16 gives f32. Float8 promotes with nothing but itself (as in
// PyTorch): a DTypeError says to cast first.
DType promote(DType a, DType b);
// The dtype arithmetic on floats of type t runs in: f64 for f64, f32 for
// the others (16-bit floats widen, as the kernels widen them; float8 would
// too, where an op takes it).
DType compute_dtype(DType t);

}  // namespace mpt
