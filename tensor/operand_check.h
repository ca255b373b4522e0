#pragma once
// Checks that the raw ops share on their operands. Each message names the op
// and describes the operands (dtype, shape, device), so a caller sees which
// call failed and why without a debugger.
#include "tensor/error.h"
#include "tensor/tensor.h"

namespace mpt {

// An operand left empty (a Tensor() never assigned, an absent gradient)
// is named with the op it was passed to; Tensor's own accessors could only
// say that some tensor was undefined.
inline void check_defined(const char* op, const Tensor& t) {
  if (!t.defined()) throw ValueError(fmt::format("{}: an operand is an undefined tensor", op));
}

// (These run on every call of every raw op: their messages are made only
// for a failure.)
inline void check_same_device(const char* op, const Tensor& a, const Tensor& b) {
  check_defined(op, a);
  check_defined(op, b);
  if (a.device() != b.device())
    throw DeviceError(fmt::format("{}: operands are on different devices: {} and {}", op, describe(a), describe(b)));
}

inline void check_same_device_and_dtype(const char* op, const Tensor& a, const Tensor& b) {
  check_same_device(op, a, b);
  if (a.dtype() != b.dtype())
    throw DTypeError(fmt::format("{}: operands differ in dtype: {} and {}", op, describe(a), describe(b)));
}

// Float8 tensors are for casts and data movement only (copies, views, cat,
// row gathers), as in PyTorch: an op that would compute on one, or convert
// it silently to compute, refuses it by name.
[[noreturn]] inline void throw_float8(const char* op, const Tensor& t) {
  throw DTypeError(fmt::format("{}: {} is float8, which holds values but does no arithmetic; cast it with to() to "
                               "f32, bf16 or f16 first",
                               op, describe(t)));
}

inline void check_no_float8(const char* op, const Tensor& t) {
  if (t.defined() && is_float8(t.dtype())) throw_float8(op, t);
}

// Floating and not float8: what arithmetic takes.
inline void check_floating(const char* op, const Tensor& t) {
  check_defined(op, t);
  if (is_float8(t.dtype())) throw_float8(op, t);
  if (!is_floating(t.dtype()))
    throw DTypeError(
        fmt::format("{}: expected a floating tensor (f32, f16, bf16, f64), got {}", op, describe(t)));
}

// An output must not hold one element at two positions (a dimension of
// stride 0, as expand() makes): several writes would race for it. As in
// PyTorch, clone() it first.
// (Both checks run on every call of an in-place op: their messages are
// made only for a failure.)
inline void check_no_internal_overlap(const char* op, const Tensor& out) {
  for (int64_t d = 0; d < out.dim(); ++d)
    if (out.strides()[d] == 0 && out.shape()[d] > 1)
      throw ValueError(fmt::format("{}: the output {} has dimension {} of stride 0, so its elements share memory; "
                                   "clone() it before writing to it",
                                   op, describe(out), d));
}

// An output may be its input (in place) but must not partly overlap it:
// elements would be read after they were overwritten, in an order the
// kernel does not promise. Decided, as PyTorch decides, only for dense
// operands; others pass.
inline void check_no_partial_overlap(const char* op, const Tensor& out, const Tensor& in) {
  if (!out.defined() || !in.defined() || out.numel() == 0 || in.numel() == 0) return;
  if (!out.is_contiguous() || !in.is_contiguous() || out.device() != in.device()) return;
  const auto* o = static_cast<const char*>(out.data_ptr());
  const auto* i = static_cast<const char*>(in.data_ptr());
  const bool apart = o + out.nbytes() <= i || i + in.nbytes() <= o;
  const bool same = o == i && out.nbytes() == in.nbytes() && out.dtype() == in.dtype();
  if (!apart && !same)
    throw ValueError(fmt::format("{}: the output {} partly overlaps the input {}; write into a separate tensor (or "
                                 "clone() the input)",
                                 op, describe(out), describe(in)));
}

}  // namespace mpt
