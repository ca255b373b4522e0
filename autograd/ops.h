#pragma once
// The differentiable op library. Each op computes its result with the raw
// ops of tensor/ops.h and, when an input requires a gradient and grad mode
// is on, records its backward rule (written beside it, in autograd/ops_*.cpp).
// Gradients have the dtype of the tensor they belong to.
#include <optional>
#include <vector>

#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "tensor/ops.h"

namespace mpt {

// A tensor sharing x's storage, cut off from the graph (no grad, no history).
Tensor detach(const Tensor& x);

// ---- element-wise (broadcasting; mixed dtypes promote) ------------------------
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, double s);
Tensor mul(const Tensor& a, double s);
Tensor neg(const Tensor& x);
Tensor pow(const Tensor& x, double exponent);
Tensor pow(const Tensor& x, const Tensor& exponent);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor tanh(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor relu(const Tensor& x);
enum class GeluApprox { none, tanh };  // none: the exact erf form (PyTorch's default)
Tensor gelu(const Tensor& x, GeluApprox approx = GeluApprox::none);
Tensor silu(const Tensor& x);  // x * sigmoid(x), also called swish

inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
inline Tensor operator-(const Tensor& x) { return neg(x); }
inline Tensor operator+(const Tensor& a, double s) { return add(a, s); }
inline Tensor operator-(const Tensor& a, double s) { return add(a, -s); }
inline Tensor operator*(const Tensor& a, double s) { return mul(a, s); }
inline Tensor operator*(double s, const Tensor& a) { return mul(a, s); }
inline Tensor operator/(const Tensor& a, double s) { return mul(a, 1.0 / s); }

// ---- reductions -----------------------------------------------------------------
Tensor sum(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);

// ---- linear algebra -------------------------------------------------------------------
Tensor matmul(const Tensor& a, const Tensor& b);  // torch.matmul for >= 2-d operands
Tensor bmm(const Tensor& a, const Tensor& b);     // [B, m, k] @ [B, k, n]
// x [..., in] @ weight[out, in]^T + bias[out], PyTorch's layout.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());
// relu(linear(x, weight, bias)) as one op: on CUDA the ReLU runs in the
// GEMM's epilogue, and the product before it is never stored.
Tensor linear_relu(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());

// ---- shape and layout ---------------------------------------------------------------
Tensor reshape(const Tensor& x, Shape shape);
Tensor view(const Tensor& x, Shape shape);
Tensor flatten(const Tensor& x, int64_t start_dim = 1);
Tensor transpose(const Tensor& x, int64_t d0, int64_t d1);
Tensor permute(const Tensor& x, const std::vector<int64_t>& dims);
Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step = 1);
Tensor unsqueeze(const Tensor& x, int64_t dim);
Tensor squeeze(const Tensor& x, int64_t dim);
Tensor expand(const Tensor& x, const Shape& shape);
Tensor contiguous(const Tensor& x);
Tensor cat(const std::vector<Tensor>& xs, int64_t dim);
std::vector<Tensor> split(const Tensor& x, int64_t size, int64_t dim);  // chunks of `size` (last may be smaller)
Tensor to(const Tensor& x, DType dtype);
// `cast` (x's values in another dtype, made by the caller: many at once,
// say) recorded as x's differentiable cast, as to(x, cast.dtype()) records
// its result; returns it.
Tensor as_cast(const Tensor& x, Tensor cast);
Tensor to(const Tensor& x, const Device& device);

// ---- neural-network functions ---------------------------------------------------------
Tensor softmax(const Tensor& x, int64_t dim);
Tensor log_softmax(const Tensor& x, int64_t dim);
enum class Reduction { mean, sum, none };
// logits [N, C] (any float dtype; the math is f32), target i64 [N]. Targets
// equal to ignore_index count neither in the loss nor in the mean.
Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index = -100,
                     Reduction reduction = Reduction::mean);
Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::mean);
// torch.nn.functional.binary_cross_entropy_with_logits: per element
// -[pos_weight * y log(sigmoid(x)) + (1 - y) log(1 - sigmoid(x))], stable for
// any logit; target of the logits' shape (values in [0, 1]); pos_weight
// broadcasts to the logits (one weight a class). Computed in f32 (f64 for
// f64) from logits of any floating dtype.
Tensor binary_cross_entropy_with_logits(const Tensor& logits, const Tensor& target,
                                        Reduction reduction = Reduction::mean, const Tensor& pos_weight = Tensor());
// Over the last dimension; weight and bias [D] may be undefined. The math
// is at least f32; the result is in out_dtype (x's when absent), rounded
// once from the f32 result: a norm feeding a matmul under autocast writes
// the dtype the matmul would cast it to (autocast_input_dtype), which saves
// the cast each way.
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5,
                  std::optional<DType> out_dtype = std::nullopt);
// {x, layer_norm(x, ...)} as one op, for a pre-norm residual block that
// adds its branch back to x: backward gets the gradient of the skip path
// and of the norm in one node, and the fused kernel adds them as it writes
// dx (else the engine adds them in a pass of its own). The first result is
// x itself (its values and storage, recorded as this op's output).
std::pair<Tensor, Tensor> layer_norm_with_skip(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                               double eps = 1e-5, std::optional<DType> out_dtype = std::nullopt);
// torch.nn.functional.batch_norm: x [N, C, ...] normalised per channel,
// then scaled by weight and shifted by bias ([C] each, or undefined). In
// training, by the batch's mean and (biased) variance, which also update
// running_mean and running_var in place when given: r = (1 - momentum) r +
// momentum * statistic, the variance unbiased. Otherwise by the running
// statistics. Computed in f32 (f64 for f64); the output has x's dtype.
Tensor batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                  const Tensor& bias, bool training, double momentum = 0.1, double eps = 1e-5);
// weight [V, D], indices i64 of any shape -> [..., D].
Tensor embedding(const Tensor& weight, const Tensor& indices);
// Zeroes each element with probability p and scales the rest by 1/(1-p).
Tensor dropout(const Tensor& x, double p, bool training = true, Generator* gen = nullptr);
// x [N, C, H, W], weight [O, C, kh, kw], bias [O] or undefined.
Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(), const Conv2dParams& p = {});
Tensor max_pool2d(const Tensor& x, const Pool2dParams& p = {});
// q [B, H, Tq, D], k and v [B, H, Tk, D] -> [B, H, Tq, D];
// softmax(q k^T * scale (+ causal mask)) v, scale 1 / sqrt(D) by default.
// The causal mask places the queries at the keys' end (query i sees keys up
// to Tk - Tq + i), as a key/value cache needs; it is PyTorch's
// causal_lower_right, where PyTorch's is_causal aligns at the start.
// attn_mask, broadcast to [B, H, Tq, Tk]: u8 (nonzero: the key takes part,
// as PyTorch's bool masks) or floating (added to the scores, in their dtype;
// it gets a gradient if it requires one); with causal, both apply. A query
// whose keys are all masked out gives zeros, as in PyTorch. Equal shapes
// without a mask take the fused kernel where the backend has one.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal = true,
                                    std::optional<double> scale = std::nullopt, const Tensor& attn_mask = Tensor());

}  // namespace mpt
