// Raw FP8 ops: quantization with a device-held scale, the running amax,
// and the scaled FP8 product. Checks and allocation here; the arithmetic
// in the backends (cpu/cpu_fp8.cpp, cuda/fp8_quantize.cu, cuda/gemm_fp8.cpp).
#include "tensor/dispatch.h"
#include "tensor/operand_check.h"
#include "tensor/ops.h"

namespace mpt::prim {
namespace {

bool is_half_or_float(DType t) { return t == DType::f32 || t == DType::f16 || t == DType::bf16; }

// A device-held f32 scalar (a scale, its inverse, an amax) beside `like`.
void check_scalar(const char* op, const char* name, const Tensor& s, const Tensor& like) {
  check_defined(op, s);
  check_same_device(op, s, like);
  check<DTypeError>(s.dtype() == DType::f32 && s.numel() == 1 && s.is_contiguous(),
                    "{}: {} must be one contiguous f32 element, got {}", op, name, describe(s));
}

void check_quantizable(const char* op, const Tensor& in) {
  check_defined(op, in);
  check<DTypeError>(is_half_or_float(in.dtype()), "{}: input {} must be f32, f16 or bf16", op, describe(in));
}

}  // namespace

bool fp8_gemm_shape_ok(int64_t m, int64_t n, int64_t k) {
  return m > 0 && n > 0 && k > 0 && m % 16 == 0 && n % 16 == 0 && k % 16 == 0;
}

void amax_into(const Tensor& amax, const Tensor& in) {
  check_quantizable("amax_into", in);
  check_scalar("amax_into", "amax", amax, in);
  const Tensor c = contiguous(in);
  if (c.numel() > 0) on_device(c.device(), [&](Backend& b) { b.amax_into(amax.view(), c.view()); });
  amax.bump_version();
}

Tensor fp8_prologue(Fp8Prologue prologue, const Tensor& in, const Tensor& aux) {
  if (prologue == Fp8Prologue::none) return in;
  return fp8_prologue_has_aux(prologue) ? binary(fp8_prologue_binary(prologue), in, aux)
                                        : unary(fp8_prologue_unary(prologue), in);
}

Fp8Quantized quantize_fp8(const Tensor& in, DType format, const Tensor& scale, const Tensor& amax,
                          bool with_transpose, Fp8Prologue prologue, const Tensor& aux, bool column_sums) {
  const char* op = "quantize_fp8";
  check_quantizable(op, in);
  check<ShapeError>(in.dim() == 2, "{}: expects a matrix [rows, cols], got {}", op, describe(in));
  check<DTypeError>(is_float8(format), "{}: the target dtype must be float8 (e4m3 or e5m2), got {}", op,
                    dtype_name(format));
  check_scalar(op, "scale", scale, in);
  if (amax.defined()) check_scalar(op, "amax", amax, in);
  const bool takes_aux = fp8_prologue_has_aux(prologue);
  check<ValueError>(takes_aux == aux.defined(), "{}: the {} prologue {}", op, fp8_prologue_name(prologue),
                    takes_aux ? "needs an aux tensor" : "takes no aux tensor");
  if (takes_aux) {
    check_same_device_and_dtype(op, aux, in);
    check<ShapeError>(aux.shape() == in.shape(), "{}: aux {} of the {} prologue does not match input {}", op,
                      describe(aux), fp8_prologue_name(prologue), describe(in));
  }
  const Tensor c = contiguous(in), a = takes_aux ? contiguous(aux) : Tensor();
  const int64_t rows = in.shape()[0], cols = in.shape()[1];
  Fp8Quantized q;
  q.data = Tensor::empty({rows, cols}, format, in.device());
  if (with_transpose) q.data_t = Tensor::empty({cols, rows}, format, in.device());
  q.scale_inv = Tensor::empty({1}, DType::f32, in.device());
  if (column_sums) q.column_sums = Tensor::empty({cols}, DType::f32, in.device());
  Fp8QuantizeArgs args;
  args.out = q.data.view();
  args.out_t = view_or_none(q.data_t);
  args.in = c.view();
  args.scale = scale.view();
  args.scale_inv = q.scale_inv.view();
  args.amax = view_or_none(amax);
  args.aux = view_or_none(a);
  args.prologue = prologue;
  args.column_sums = view_or_none(q.column_sums);
  if (rows == 0 && column_sums) fill_(q.column_sums, 0.0);
  on_device(in.device(), [&](Backend& b) { b.quantize_fp8(args); });
  if (amax.defined()) amax.bump_version();
  return q;
}

Tensor gemm_fp8(const Tensor& a, const Tensor& a_scale_inv, const Tensor& b, const Tensor& b_scale_inv,
                const Tensor& bias, DType out_dtype, bool fast_accumulation, bool relu) {
  const char* op = "gemm_fp8";
  check_same_device(op, a, b);
  check<DTypeError>(is_float8(a.dtype()) && is_float8(b.dtype()) &&
                        !(a.dtype() == DType::e5m2 && b.dtype() == DType::e5m2),
                    "{}: operands must be float8, not both e5m2, got {} and {}", op, describe(a), describe(b));
  check<ShapeError>(a.dim() == 2 && b.dim() == 2 && a.shape()[1] == b.shape()[1],
                    "{}: expects a [m, k] and b [n, k] (a linear layer's input and weight), got {} and {}", op,
                    describe(a), describe(b));
  const int64_t m = a.shape()[0], n = b.shape()[0], k = a.shape()[1];
  check<ShapeError>(fp8_gemm_shape_ok(m, n, k),
                    "{}: FP8 products need every size a positive multiple of 16 (m {}, n {}, k {} for {} x {}^T)",
                    op, m, n, k, describe(a), describe(b));
  check<DTypeError>(is_half_or_float(out_dtype), "{}: the output must be f32, f16 or bf16, got {}", op,
                    dtype_name(out_dtype));
  check_scalar(op, "a_scale_inv", a_scale_inv, a);
  check_scalar(op, "b_scale_inv", b_scale_inv, a);
  if (bias.defined()) {
    check_same_device(op, bias, a);
    check<ShapeError>(bias.dtype() == out_dtype && bias.dim() == 1 && bias.shape()[0] == n,
                      "{}: bias {} must be {} [{}], the output's dtype", op, describe(bias), dtype_name(out_dtype), n);
  }
  const Tensor ca = contiguous(a), cb = contiguous(b), cbias = bias.defined() ? contiguous(bias) : Tensor();
  Tensor out = Tensor::empty({m, n}, out_dtype, a.device());
  Fp8GemmArgs args;
  args.a = ca.view();
  args.b = cb.view();
  args.out = out.view();
  args.a_scale_inv = a_scale_inv.view();
  args.b_scale_inv = b_scale_inv.view();
  args.bias = view_or_none(cbias);
  args.fast_accumulation = fast_accumulation;
  args.relu = relu;
  on_device(a.device(), [&](Backend& be) { be.gemm_fp8(args); });
  return out;
}

}  // namespace mpt::prim
