#pragma once
// Element types. f16 and bf16 are real storage types on every device; the CPU
// converts with IEEE round-to-nearest-even exactly as the GPU does.
#include <cstddef>
#include <cstdint>
#include <string>

namespace mpt {

enum class DType : uint8_t { f32, f16, bf16, f64, i32, i64, u8 };

inline constexpr DType kAllDTypes[] = {DType::f32, DType::f16, DType::bf16, DType::f64,
                                       DType::i32, DType::i64, DType::u8};

size_t dtype_size(DType t);
const char* dtype_name(DType t);
DType dtype_from_name(const std::string& name);  // "f32", "float16", "bf16", ...
bool is_floating(DType t);
// The wider of two dtypes, as PyTorch promotes: floats win over integers,
// f16 with bf16 gives f32.
DType promote(DType a, DType b);
// The dtype arithmetic on floats of type t runs in: f64 for f64, f32 for
// the others (16-bit floats widen, as the kernels widen them).
DType compute_dtype(DType t);

}  // namespace mpt
