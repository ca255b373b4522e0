#pragma once
// Raw tensor arithmetic: checks, broadcasting, dtype promotion and
// allocation, then a backend call. Nothing here records autograd history;
// autograd/ops.h wraps these with backward rules.
#include <initializer_list>
#include <optional>
#include <vector>

#include "tensor/backend.h"
#include "tensor/random.h"
#include "tensor/tensor.h"

namespace mpt {

// ---- creation ---------------------------------------------------------------
Tensor zeros(const Shape& shape, DType dtype = DType::f32, const Device& device = kCPU);
Tensor ones(const Shape& shape, DType dtype = DType::f32, const Device& device = kCPU);
Tensor full(const Shape& shape, double value, DType dtype = DType::f32, const Device& device = kCPU);
Tensor arange(double start, double end, double step = 1.0, DType dtype = DType::f32, const Device& device = kCPU);
// Standard normal / uniform [low, high), from `gen` (the thread's default generator if null).
Tensor randn(const Shape& shape, DType dtype = DType::f32, const Device& device = kCPU, Generator* gen = nullptr);
Tensor rand(const Shape& shape, DType dtype = DType::f32, const Device& device = kCPU, Generator* gen = nullptr,
            double low = 0.0, double high = 1.0);
// From host values (converted to dtype).
template <typename T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape, DType dtype, const Device& device = kCPU);
Tensor from_vector(const std::vector<float>& values, const Shape& shape, const Device& device = kCPU);
Tensor scalar_tensor(double value, DType dtype = DType::f32, const Device& device = kCPU);

namespace prim {

// ---- copies and conversions -------------------------------------------------
Tensor to(const Tensor& t, const Device& device);  // same tensor if already there
Tensor to(const Tensor& t, DType dtype);           // same tensor if already that dtype
Tensor contiguous(const Tensor& t);                // same tensor if already contiguous
Tensor clone(const Tensor& t);
void copy_(const Tensor& dst, const Tensor& src);  // any devices and dtypes; src broadcasts to dst
// dsts[i] = srcs[i] * scale, each pair of one shape and device, computed in
// f32 for 16-bit types (f64 where either side is f64) and rounded once: a
// scale of 1 casts bit for bit as copy_ does. On a GPU, the contiguous pairs
// with the first pair's two dtypes (f32, f16 or bf16) go in one kernel
// launch; on the CPU they are split over its threads as one range of
// elements. The others go one at a time.
void scaled_copy_list_(const std::vector<Tensor>& dsts, const std::vector<Tensor>& srcs, double scale);
void fill_(const Tensor& dst, double value);

// ---- views (share storage) --------------------------------------------------
Tensor view(const Tensor& t, Shape shape);     // one -1 allowed; needs compatible strides
Tensor reshape(const Tensor& t, Shape shape);  // a view when possible, else a copy
Tensor transpose(const Tensor& t, int64_t d0, int64_t d1);
Tensor permute(const Tensor& t, const std::vector<int64_t>& dims);
Tensor slice(const Tensor& t, int64_t dim, int64_t start, int64_t end, int64_t step = 1);
// The contiguous tensor of shape `whole` whose consecutive slices along dim
// are `parts` (each `size` long there), as a view, when the parts already
// lie so in one block of memory; nullopt otherwise (the caller copies).
std::optional<Tensor> joined_slices(const std::vector<Tensor>& parts, int64_t dim, int64_t size, const Shape& whole);
Tensor expand(const Tensor& t, const Shape& shape);
Tensor unsqueeze(const Tensor& t, int64_t dim);
Tensor squeeze(const Tensor& t, int64_t dim);

// ---- element-wise -----------------------------------------------------------
Tensor unary(UnaryOp op, const Tensor& x, double alpha = 0.0, double beta = 0.0);
// Broadcasting; mixed dtypes promote to the wider one.
Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b);
void unary_(UnaryOp op, const Tensor& out, const Tensor& x, double alpha = 0.0, double beta = 0.0);
void binary_(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b);  // out has the broadcast shape

inline Tensor add(const Tensor& a, const Tensor& b) { return binary(BinaryOp::add, a, b); }
inline Tensor sub(const Tensor& a, const Tensor& b) { return binary(BinaryOp::sub, a, b); }
inline Tensor mul(const Tensor& a, const Tensor& b) { return binary(BinaryOp::mul, a, b); }
inline Tensor div(const Tensor& a, const Tensor& b) { return binary(BinaryOp::div, a, b); }
inline Tensor neg(const Tensor& x) { return unary(UnaryOp::neg, x); }
inline Tensor mul_scalar(const Tensor& x, double s) { return unary(UnaryOp::affine, x, s, 0.0); }
inline Tensor add_scalar(const Tensor& x, double s) { return unary(UnaryOp::affine, x, 1.0, s); }

// ---- reductions -------------------------------------------------------------
// Over `dims` (all dims when empty). Floating inputs accumulate in f32 (f64 for f64).
Tensor reduce(ReduceOp op, const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
inline Tensor sum(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false) {
  return reduce(ReduceOp::sum, x, dims, keepdim);
}
inline Tensor mean(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false) {
  return reduce(ReduceOp::mean, x, dims, keepdim);
}
inline Tensor amax(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false) {
  return reduce(ReduceOp::max, x, dims, keepdim);
}
inline Tensor amin(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false) {
  return reduce(ReduceOp::min, x, dims, keepdim);
}
Tensor argmax(const Tensor& x, int64_t dim, bool keepdim = false);  // i64

// ---- matrix products --------------------------------------------------------
// torch.matmul for operands of 2 or more dimensions: batch dimensions
// broadcast. f16/bf16 inputs accumulate in f32. Same dtype required.
Tensor matmul(const Tensor& a, const Tensor& b);
// A linear layer's forward: x [rows, in] @ weight [out, in]^T + bias [out]
// (bias may be undefined), the bias added in the GEMM's epilogue, and with
// `relu` a ReLU after it in the epilogue as well.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias, bool relu = false);
// A linear layer's weight gradient grad^T @ x ([out, in], from grad [rows,
// out] and x [rows, in]) and, when `with_bias`, the bias gradient (grad's
// column sums, [out]) from the same GEMM; otherwise the second is undefined.
std::pair<Tensor, Tensor> linear_weight_grad(const Tensor& grad, const Tensor& x, bool with_bias);

// ---- joining ------------------------------------------------------------------------
Tensor cat(const std::vector<Tensor>& xs, int64_t dim);  // same dtype and device, shapes equal but in dim

// ---- gathers, convolution, pooling -----------------------------------------------------
// table [V, D], indices i64 of any shape -> [..., D]. Out-of-range indices
// throw ValueError on the CPU; on a GPU they give zero rows (and are skipped
// by index_add_rows_), and the caller enqueues check_index_range
// (tensor/index_check.h), as embedding does, to hear of them.
Tensor index_select_rows(const Tensor& table, const Tensor& indices);
// table[indices[i], :] += src[i, :] with src [..., D] matching indices' shape.
void index_add_rows_(const Tensor& table, const Tensor& indices, const Tensor& src);
Tensor conv2d(const Tensor& x, const Tensor& weight, const Conv2dParams& p);
Tensor conv2d_backward_data(const Tensor& grad_out, const Tensor& weight, const Shape& x_shape, const Conv2dParams& p);
Tensor conv2d_backward_weight(const Tensor& x, const Tensor& grad_out, const Shape& w_shape, const Conv2dParams& p);
// Returns (out, indices).
std::pair<Tensor, Tensor> max_pool2d(const Tensor& x, const Pool2dParams& p);
Tensor max_pool2d_backward(const Tensor& grad_out, const Tensor& indices, const Shape& x_shape, const Pool2dParams& p);

// Fused layer norm over the last dimension, where the device's backend has
// it for x's dtype, the output's dtype and the row length; weight and bias
// ([d], x's dtype and device) may be undefined.
bool fused_layer_norm_available(const Tensor& x, const Tensor& weight, const Tensor& bias, DType out_dtype);
// {out, mean, rstd}: out in out_dtype; mean and rstd are f32, one per row.
std::vector<Tensor> layer_norm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                                       DType out_dtype);
// {grad_x, grad_weight, grad_bias}: grad_out in the forward's out_dtype,
// grad_x in x's, with grad_x_more (when defined: a gradient that reached x
// by another path) added in; the parameter gradients are f32, and undefined
// unless asked for.
std::vector<Tensor> layer_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                                        const Tensor& mean, const Tensor& rstd, bool want_weight, bool want_bias,
                                        const Tensor& grad_x_more = Tensor());

// Fused batch norm where the device's backend has it for x's dtype: x
// [N, C, ...] of at least one element, the per-channel tensors (any may be
// undefined) f32 [C] on x's device, contiguous.
bool fused_batch_norm_available(const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                                const Tensor& weight, const Tensor& bias);
// {out, mean, rstd}: out like x, mean and rstd f32 [C] (the batch's with
// `training`, which also blends them into the running ones in place; else
// the running ones').
std::vector<Tensor> batch_norm_forward(const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                                       const Tensor& weight, const Tensor& bias, bool training, double momentum,
                                       double eps);
// {grad_x, grad_weight, grad_bias}: grad_x like x (undefined unless
// want_x), the parameter gradients f32 [C] (undefined unless asked for).
std::vector<Tensor> batch_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                                        const Tensor& mean, const Tensor& rstd, bool training, bool want_x,
                                        bool want_weight, bool want_bias);

// Fused cross-entropy where the device's backend has it for the logits'
// dtype: logits [N, C], target i64 [N] (indices checked by the caller).
bool fused_cross_entropy_available(const Tensor& logits);
// {loss, lse, valid}, each f32 [N]; loss and valid are 0 for ignored rows.
std::vector<Tensor> cross_entropy_forward(const Tensor& logits, const Tensor& target, int64_t ignore_index);
// (softmax(logits) - onehot(target)) * row_scale, in the logits' dtype.
Tensor cross_entropy_backward(const Tensor& logits, const Tensor& target, const Tensor& lse, const Tensor& row_scale);

// Fused attention on q, k, v [B, H, T, D] of one shape, dtype and device,
// where the device's backend has it for this dtype and head size.
bool fused_attention_available(const Tensor& q, const Tensor& k, const Tensor& v);
// {out, lse}: lse (f32 [B, H, T]) is what the backward pass needs.
std::pair<Tensor, Tensor> attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                            double scale);
// {grad_q, grad_k, grad_v}.
std::vector<Tensor> attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                       const Tensor& lse, const Tensor& grad_out, bool causal, double scale);

// FP8 (tensor/backend.h's Fp8QuantizeArgs and Fp8GemmArgs; the recipes
// that own the scales are amp/fp8_scaling.h's).
struct Fp8Quantized {
  Tensor data;         // float8 [rows, cols]
  Tensor data_t;       // float8 [cols, rows], where asked for
  Tensor scale_inv;    // f32 [1]: 1 / the scale used
  Tensor column_sums;  // f32 [cols], where asked for
};
// `in` [rows, cols] (f32, f16, bf16) times `scale` (f32 [1], on in's
// device), saturated to `format` (e4m3 or e5m2); amax (f32 [1]) or
// undefined: max-combined with max |in|. prologue: an element-wise op
// applied to `in` first (Fp8Prologue; aux, in's shape and dtype, where it
// takes one), the scale, amax and sums then of its result; column_sums:
// also the f32 sums of the rows (a bias gradient), in Fp8QuantizeArgs's
// fixed order.
Fp8Quantized quantize_fp8(const Tensor& in, DType format, const Tensor& scale, const Tensor& amax,
                          bool with_transpose, Fp8Prologue prologue = Fp8Prologue::none, const Tensor& aux = Tensor(),
                          bool column_sums = false);
// The prologue's result on its own: what quantize_fp8 quantizes.
Tensor fp8_prologue(Fp8Prologue prologue, const Tensor& in, const Tensor& aux);
// amax (f32 [1]) = max(amax, max |in|); NaN once `in` holds one.
void amax_into(const Tensor& amax, const Tensor& in);
// Whether an FP8 product of these sizes can run: each a positive multiple
// of 16, as Hopper's FP8 GEMMs need (checked the same on every device).
bool fp8_gemm_shape_ok(int64_t m, int64_t n, int64_t k);
// (a [m, k] . b [n, k]^T) * a_scale_inv * b_scale_inv (+ bias [n]) in
// out_dtype, accumulated in f32 (fast_accumulation: see Fp8GemmArgs), then
// a ReLU where asked for.
Tensor gemm_fp8(const Tensor& a, const Tensor& a_scale_inv, const Tensor& b, const Tensor& b_scale_inv,
                const Tensor& bias, DType out_dtype, bool fast_accumulation, bool relu = false);

}  // namespace prim
}  // namespace mpt
