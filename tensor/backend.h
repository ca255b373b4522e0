#pragma once
// The narrow interface every device backend implements. Ops in tensor/ops.h
// check their operands, broadcast, promote and allocate, then call one of
// these with plain views; a backend only does the arithmetic. Adding a
// backend or a dtype touches nothing above this file.
#include <cstdint>

#include "tensor/device.h"
#include "tensor/tensor_view.h"

namespace mpt {

// Each op family is one list, X(enumerator, name): the enum and its names
// both come from it, so they cannot fall out of step. The backends and the
// ops switch over the enums (the compiler checks that every case is there).
#define MPT_UNARY_OPS(X)                                                                                   \
  X(neg, "neg") X(exp, "exp") X(log, "log") X(sqrt, "sqrt") X(rsqrt, "rsqrt") X(tanh, "tanh")             \
  X(sigmoid, "sigmoid") X(relu, "relu") X(gelu_tanh, "gelu_tanh") X(gelu_erf, "gelu_erf") X(abs, "abs")   \
  X(sin, "sin") X(cos, "cos") X(square, "square") X(reciprocal, "reciprocal")                             \
  X(affine, "affine")   /* x * alpha + beta */                                                            \
  X(pow_scalar, "pow")  /* x ^ alpha */                                                                   \
  X(step, "step")       /* 1 where x > 0, else 0 */

#define MPT_BINARY_OPS(X)                                                                                  \
  X(add, "add") X(sub, "sub") X(mul, "mul") X(div, "div") X(pow, "pow") X(maximum, "maximum")             \
  X(minimum, "minimum")                                                                                   \
  /* 1 or 0 in the operands' dtype */                                                                     \
  X(eq, "eq") X(ne, "ne") X(lt, "lt") X(le, "le") X(gt, "gt") X(ge, "ge")                                 \
  X(relu_backward, "relu_backward")           /* a * (b > 0)        (a = grad, b = input) */              \
  X(gelu_tanh_backward, "gelu_tanh_backward") /* a * d/dx gelu_tanh(b) */                                 \
  X(gelu_erf_backward, "gelu_erf_backward")   /* a * d/dx gelu_erf(b) */                                  \
  X(tanh_backward, "tanh_backward")           /* a * (1 - b^2)      (b = output) */                       \
  X(sigmoid_backward, "sigmoid_backward")     /* a * b * (1 - b)    (b = output) */

#define MPT_REDUCE_OPS(X) X(sum, "sum") X(mean, "mean") X(max, "amax") X(min, "amin") X(argmax, "argmax")

#define MPT_OP_ENUMERATOR(enumerator, name) enumerator,
enum class UnaryOp : uint8_t { MPT_UNARY_OPS(MPT_OP_ENUMERATOR) };
enum class BinaryOp : uint8_t { MPT_BINARY_OPS(MPT_OP_ENUMERATOR) };
enum class ReduceOp : uint8_t { MPT_REDUCE_OPS(MPT_OP_ENUMERATOR) };
#undef MPT_OP_ENUMERATOR

const char* unary_op_name(UnaryOp op);
const char* binary_op_name(BinaryOp op);
const char* reduce_op_name(ReduceOp op);

// out = alpha * (a @ b) + beta * out, batched. All three are 3-d views:
// a [batch, m, k], b [batch, k, n], out [batch, m, n] (contiguous). In a and b
// one of the last two strides is 1; the batch stride may be 0 (broadcast).
// Half inputs accumulate in f32.
//
// Two optional epilogues (a view with data == nullptr is unused; batch 1,
// beta 0, contiguous 1-d views of out's dtype), fused into the GEMM where the
// backend can:
// - bias [n]: added to every row of out (a linear layer's forward);
// - bias_grad [m]: set to the sums of a's rows over k (with a = dY^T in a
//   weight gradient dW = dY^T X, these are the bias gradient).
// And `relu`: out = max(out, 0) after the bias (NaN stays NaN, as relu()
// keeps it), never together with bias_grad.
struct GemmArgs {
  TensorView a, b, out;
  float alpha = 1.0f;
  float beta = 0.0f;
  TensorView bias;
  TensorView bias_grad;
  bool relu = false;
};

// Throws unless the epilogues of `g` (if any) are as GemmArgs describes.
void check_gemm_epilogues(const GemmArgs& g);

// Quantization to FP8 of a contiguous [rows, cols] tensor `in` (f32, f16
// or bf16): out = fp8(in * scale), rounded to nearest even and saturated to
// the format's largest finite value (NaN stays NaN), with the scale f32 [1]
// on the device (amp/fp8_scaling.h's recipes keep it there). scale_inv
// receives 1 / scale, for the GEMM to undo it; amax, where given, the
// running maximum of |in| (amax_into's rule).
//
// An element-wise op can ride along, applied to each element before
// anything else sees it (the prologue): the op that produced `in` or the
// backward of the op that follows it, folded into the quantization so that
// its own result is never written. Each value is the op's own, computed in
// f32 and rounded to in's dtype as the op alone would store it:
//   relu_backward       aux > 0 ? in : 0        (aux: the ReLU's output)
//   gelu_erf, gelu_tanh gelu(in)                 (no aux)
//   gelu_*_backward     in * gelu'(aux)          (aux: GELU's input)
// A linear layer's output gradient also gives its bias gradient
// (column_sums: the sums over the rows, in f32, in a fixed order: over
// blocks of kFp8ColumnSumBlock rows in order, then those block sums in
// order, so that every device gives the same bits).
inline constexpr int64_t kFp8ColumnSumBlock = 64;
enum class Fp8Prologue : uint8_t { none, relu_backward, gelu_erf, gelu_tanh, gelu_erf_backward, gelu_tanh_backward };
// Whether the prologue reads aux; the element-wise op that computes it
// alone (UnaryOp for gelu_erf and gelu_tanh, BinaryOp for the rest).
constexpr bool fp8_prologue_has_aux(Fp8Prologue p) {
  return p == Fp8Prologue::relu_backward || p == Fp8Prologue::gelu_erf_backward || p == Fp8Prologue::gelu_tanh_backward;
}
UnaryOp fp8_prologue_unary(Fp8Prologue p);
BinaryOp fp8_prologue_binary(Fp8Prologue p);
const char* fp8_prologue_name(Fp8Prologue p);
struct Fp8QuantizeArgs {
  TensorView out;          // float8 [rows, cols]
  TensorView out_t;        // null, or float8 [cols, rows]: in's transpose, quantized alike (for backward products)
  TensorView in;           // [rows, cols]
  TensorView scale;        // f32 [1]
  TensorView scale_inv;    // f32 [1], written
  TensorView amax;         // null, or f32 [1], as amax_into
  TensorView aux;          // null, or [rows, cols] of in's dtype: see Fp8Prologue
  Fp8Prologue prologue = Fp8Prologue::none;
  TensorView column_sums;  // null, or f32 [cols], written
};

// out [m, n] = (a [m, k] . b [n, k]^T) * a_scale_inv * b_scale_inv (+ bias
// [n]), accumulated in f32: a linear layer's shape (b is the weight). a and
// b contiguous float8 (not both e5m2), the scales f32 [1] on the device,
// out contiguous f32, f16 or bf16, bias null or out's dtype. Every size a
// multiple of 16 (fp8_gemm_shape_ok), as Hopper's FP8 GEMMs need.
// fast_accumulation: the GPU's FP8 tensor cores keep the running sums in
// fewer than f32's bits (no periodic promotion to f32); faster, a little
// less exact, and what forward products can afford.
// relu: out = max(out, 0) after the bias (NaN stays NaN, as relu() keeps it).
struct Fp8GemmArgs {
  TensorView a, b, out;
  TensorView a_scale_inv, b_scale_inv;
  TensorView bias;
  bool fast_accumulation = false;
  bool relu = false;
};

// 2-d convolution geometry (NCHW activations, [out, in, kh, kw] weights).
struct Conv2dParams {
  int64_t stride_h = 1, stride_w = 1;
  int64_t pad_h = 0, pad_w = 0;
  int64_t dilation_h = 1, dilation_w = 1;
};

// 2-d max pooling geometry.
struct Pool2dParams {
  int64_t kernel_h = 2, kernel_w = 2;
  int64_t stride_h = 2, stride_w = 2;
  int64_t pad_h = 0, pad_w = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // out[...] = value (out may be strided).
  virtual void fill(const TensorView& out, double value) = 0;
  // Element-wise copy with dtype conversion; same shape, any strides.
  virtual void copy(const TensorView& dst, const TensorView& src) = 0;
  // out = op(in) elementwise; `in` may carry broadcast (0) strides; same dtype.
  virtual void unary(UnaryOp op, const TensorView& out, const TensorView& in, double alpha, double beta) = 0;
  // out = op(a, b); a and b already broadcast to out's shape; same dtype,
  // or the dtypes binary_takes_mixed accepts (inputs converted as loaded).
  virtual void binary(BinaryOp op, const TensorView& out, const TensorView& a, const TensorView& b) = 0;
  virtual bool binary_takes_mixed(DType out, DType a, DType b) const { return false; }
  // `in` is contiguous [outer, k, inner]; out is contiguous [outer, inner].
  // Floating inputs accumulate in f32 (f64 for f64). argmax writes i64.
  virtual void reduce(ReduceOp op, const TensorView& out, const TensorView& in, int64_t outer, int64_t k,
                      int64_t inner) = 0;
  virtual void gemm(const GemmArgs& args) = 0;
  // Contiguous out. Element i is drawn from Philox4x32-10 (key = seed,
  // counter = offset + i / 4), identically on every backend.
  virtual void uniform(const TensorView& out, uint64_t seed, uint64_t offset, double low, double high) = 0;
  virtual void normal(const TensorView& out, uint64_t seed, uint64_t offset, double mean, double stddev) = 0;
  // out[i] = start + i * step, contiguous out.
  virtual void arange(const TensorView& out, double start, double step) = 0;

  // The ops below have default bodies that throw NotAvailableError, so a
  // backend can grow them one at a time.

  // Row gather: out[i, :] = table[idx[i], :]. table [V, D], idx i64 [N],
  // out [N, D], all contiguous; every idx in [0, V) (checked by the caller).
  virtual void index_select_rows(const TensorView& out, const TensorView& table, const TensorView& idx);
  // Row scatter-add: table[idx[i], :] += src[i, :] (repeated indices add up).
  virtual void index_add_rows(const TensorView& table, const TensorView& idx, const TensorView& src);

  // Convolution, all operands contiguous and of one dtype; half types
  // accumulate in f32. out/grad_* are overwritten.
  virtual void conv2d_forward(const TensorView& out, const TensorView& x, const TensorView& w,
                              const Conv2dParams& p);
  virtual void conv2d_backward_data(const TensorView& grad_x, const TensorView& grad_out, const TensorView& w,
                                    const Conv2dParams& p);
  virtual void conv2d_backward_weight(const TensorView& grad_w, const TensorView& x, const TensorView& grad_out,
                                      const Conv2dParams& p);

  // Max pooling over NCHW, contiguous. `indices` (i64, same shape as out)
  // receives the flat position (h * W + w) of each maximum in its plane.
  virtual void max_pool2d_forward(const TensorView& out, const TensorView& indices, const TensorView& x,
                                  const Pool2dParams& p);
  // grad_x (overwritten) gets each grad_out element added at its index.
  virtual void max_pool2d_backward(const TensorView& grad_x, const TensorView& grad_out, const TensorView& indices,
                                   const Pool2dParams& p);

  // Fused layer norm over the last dimension of x, viewed as contiguous
  // [rows, d]. weight and bias ([d], x's dtype) may have null data (absent).
  // out x's shape in out_dtype (x's, or a 16-bit dtype where x is f32, as
  // supported says); mean and rstd f32 [rows] (saved for the backward pass).
  virtual bool fused_layer_norm_supported(DType dtype, DType out_dtype, int64_t d) const { return false; }
  virtual void layer_norm_forward(const TensorView& out, const TensorView& mean, const TensorView& rstd,
                                  const TensorView& x, const TensorView& weight, const TensorView& bias, double eps);
  // grad_x like x; grad_out like the forward's out; grad_x_more null data,
  // or a gradient like x to add into grad_x; grad_x_narrow null data, or
  // (where x is f32 and grad_out 16-bit) grad_x's values rounded to
  // grad_out's dtype; grad_weight and grad_bias f32 [d], or null data when
  // not wanted.
  virtual void layer_norm_backward(const TensorView& grad_x, const TensorView& grad_x_narrow,
                                   const TensorView& grad_weight, const TensorView& grad_bias,
                                   const TensorView& grad_out, const TensorView& grad_x_more, const TensorView& x,
                                   const TensorView& weight, const TensorView& mean, const TensorView& rstd);

  // Fused batch norm of x [N, C, ...] (contiguous), per channel over the
  // other dimensions. weight, bias, running_mean and running_var are f32
  // [C] (any may have null data: absent; the running ones both or neither);
  // mean and rstd f32 [C], written here and read by the backward pass. With
  // `training`, the batch's statistics normalise and blend into the running
  // ones in place (r = (1 - momentum) r + momentum * statistic, the variance
  // unbiased); otherwise the running ones normalise. out like x.
  virtual bool fused_batch_norm_supported(DType dtype) const { return false; }
  virtual void batch_norm_forward(const TensorView& out, const TensorView& mean, const TensorView& rstd,
                                  const TensorView& x, const TensorView& weight, const TensorView& bias,
                                  const TensorView& running_mean, const TensorView& running_var, bool training,
                                  double momentum, double eps);
  // grad_x (null data: not wanted) and grad_out like x; grad_weight and
  // grad_bias f32 [C], or null data when not wanted. `training` as the
  // forward's: batch statistics depend on x, running ones do not.
  virtual void batch_norm_backward(const TensorView& grad_x, const TensorView& grad_weight,
                                   const TensorView& grad_bias, const TensorView& grad_out, const TensorView& x,
                                   const TensorView& weight, const TensorView& mean, const TensorView& rstd,
                                   bool training);

  // Fused cross-entropy of logits [N, C] (contiguous) against i64 targets
  // [N] (in range or ignore_index; the caller checks). loss, lse, valid: f32
  // [N]; loss and valid are 0 where the target is ignored.
  virtual bool fused_cross_entropy_supported(DType dtype) const { return false; }
  virtual void cross_entropy_forward(const TensorView& loss, const TensorView& lse, const TensorView& valid,
                                     const TensorView& logits, const TensorView& target, int64_t ignore_index);
  // grad (logits' dtype) = (softmax(logits) - onehot(target)) * row_scale (f32 [N]).
  virtual void cross_entropy_backward(const TensorView& grad, const TensorView& logits, const TensorView& target,
                                      const TensorView& lse, const TensorView& row_scale);

  // dsts[i] = srcs[i] * scale, computed in f32: contiguous tensors of this
  // device, every source of one floating dtype and every destination of one
  // (f32, f16 or bf16), in as few launches as a multi-tensor kernel allows.
  virtual void scaled_copy_list(const std::vector<TensorView>& dsts, const std::vector<TensorView>& srcs,
                                double scale);

  // Fused attention softmax(q k^T * scale [+ causal mask]) v, with q, k, v
  // and out [B, H, T, D] views of one dtype whose last stride is 1 (batch,
  // head and row strides are free: q, k and v may be cut from one [B, T, 3C]
  // projection, out may be laid out [B, T, H, D]). Where a backend has it
  // (fused_attention_supported), autograd uses it instead of the composed
  // math. lse: f32 contiguous [B, H, T], each row's log-sum-exp of the
  // scaled scores.
  virtual bool fused_attention_supported(DType dtype, int64_t head_dim) const { return false; }
  virtual void attention_forward(const TensorView& out, const TensorView& lse, const TensorView& q,
                                 const TensorView& k, const TensorView& v, bool causal, double scale);
  // grad_q, grad_k, grad_v, grad_out: views as q, of its dtype; delta: f32
  // [B, H, T] scratch.
  virtual void attention_backward(const TensorView& grad_q, const TensorView& grad_k, const TensorView& grad_v,
                                  const TensorView& delta, const TensorView& q, const TensorView& k,
                                  const TensorView& v, const TensorView& out, const TensorView& lse,
                                  const TensorView& grad_out, bool causal, double scale);

  // FP8 (amp/fp8_scaling.h's recipes): see Fp8QuantizeArgs and Fp8GemmArgs.
  virtual void quantize_fp8(const Fp8QuantizeArgs& args);
  virtual void gemm_fp8(const Fp8GemmArgs& args);
  // amax (f32 [1]) = max(amax, max |in|) over a contiguous f32, f16 or bf16
  // `in`; NaN once any element is NaN (so that a recipe sees the overflow).
  virtual void amax_into(const TensorView& amax, const TensorView& in);
};

// The backend for a device type. Throws DeviceError for CUDA in a build
// without it.
Backend& backend_for(const Device& d);

}  // namespace mpt
