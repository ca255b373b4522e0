// Bad input over the public API, one row per mistake a user can make: wrong
// shapes, dtypes and devices, empty tensors, zero batches, out-of-range
// indices, NaN and out-of-range options. Every row must raise the right
// mpt::Error subclass with a message that names the op and the offending
// shape or value; a row that crashes fails on its own (each row is its own
// test case), and again with oneDNN running every CPU product.
#include <cmath>
#include <functional>
#include <limits>

#include "amp/grad_scaler.h"
#include "autograd/ops.h"
#include "models/adamw.h"
#include "models/batch_norm.h"
#include "models/char_dataset.h"
#include "models/clip_grad.h"
#include "models/data_loader.h"
#include "models/gpt.h"
#include "models/layers.h"
#include "models/lr_schedule.h"
#include "models/mlp.h"
#include "models/sampler.h"
#include "models/sgd.h"
#include "tensor/backend_settings.h"
#include "test_util.h"

using namespace mpt;
using mpt::testing::expect_contains;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

struct BadInput {
  std::string name;  // the test case's name
  std::function<void()> call;
  std::function<bool(const Error&)> is_expected;  // the subclass it must raise
  std::string expected_type;
  std::vector<std::string> message_parts;  // the op and the shapes or values at fault
};

template <typename E>
BadInput row(std::string name, std::function<void()> call, std::vector<std::string> parts, const char* type) {
  return {std::move(name), std::move(call), [](const Error& e) { return dynamic_cast<const E*>(&e) != nullptr; },
          type, std::move(parts)};
}
#define ROW(E, name, parts, ...) row<E>(name, [] { __VA_ARGS__; }, parts, #E)

Tensor f32(Shape s) { return zeros(s, DType::f32); }
Tensor i64(std::vector<int64_t> v) { return from_vector<int64_t>(v, {int64_t(v.size())}, DType::i64); }
Tensor param(Shape s) { return zeros(s).set_requires_grad(true); }
using strings = std::vector<std::string>;

std::vector<BadInput> table() {
  return {
      // ---- factories and shapes ----
      ROW(ShapeError, "zeros_negative_size", (strings{"[2, -3]"}), zeros({2, -3})),
      ROW(ShapeError, "from_vector_count_mismatch", (strings{"from_vector", "[2, 2]", "3"}),
          from_vector(std::vector<float>{1, 2, 3}, {2, 2})),
      ROW(ValueError, "arange_zero_step", (strings{"arange", "step"}), arange(0, 10, 0)),
      ROW(ValueError, "arange_nan_end", (strings{"arange", "nan"}), arange(0, kNaN)),
      ROW(ValueError, "copy_into_an_expanded_tensor", (strings{"copy_", "f32[4, 3]", "stride 0"}),
          prim::copy_(prim::expand(f32({1, 3}), {4, 3}), f32({4, 3}))),
      ROW(ValueError, "copy_between_overlapping_slices", (strings{"copy_", "partly overlaps", "f32[5]"}), {
        const Tensor t = f32({6});
        prim::copy_(prim::slice(t, 0, 1, 6), prim::slice(t, 0, 0, 5));
      }),
      ROW(ValueError, "add_into_a_shifted_input", (strings{"add", "partly overlaps"}), {
        const Tensor t = f32({6});
        prim::binary_(BinaryOp::add, prim::slice(t, 0, 0, 5), prim::slice(t, 0, 1, 6), f32({5}));
      }),
      ROW(ShapeError, "add_broadcast_past_eight_dims", (strings{"at most 8 dimensions", "[1, 1, 1, 1, 1, 1, 1, 1, 2]"}),
          prim::add(f32({1, 1, 1, 1, 1, 1, 1, 1, 2}), f32({2}))),
      ROW(ShapeError, "copy_into_nine_dims", (strings{"at most 8 dimensions", "[1, 1, 1, 1, 1, 1, 1, 1, 2]"}),
          prim::copy_(f32({1, 1, 1, 1, 1, 1, 1, 1, 2}), f32({2}))),
      ROW(ShapeError, "reshape_wrong_count", (strings{"reshape", "f32[2, 3]", "[4, 2]"}), reshape(f32({2, 3}), {4, 2})),
      ROW(ShapeError, "view_two_inferred", (strings{"view", "-1"}), view(f32({2, 3}), {-1, -1})),
      ROW(ShapeError, "view_inferred_of_empty", (strings{"view", "f32[0, 3]"}), view(f32({0, 3}), {-1, 0})),
      ROW(ShapeError, "transpose_dim_out_of_range", (strings{"transpose", "dimension 5", "2 dimensions"}),
          transpose(f32({2, 3}), 0, 5)),
      ROW(ShapeError, "permute_repeated_dim", (strings{"permute", "repeated"}), permute(f32({2, 3}), {0, 0})),
      ROW(ShapeError, "permute_wrong_count", (strings{"permute", "3 dimensions", "f32[2, 3]"}),
          permute(f32({2, 3}), {0, 1, 2})),
      ROW(ValueError, "slice_zero_step", (strings{"slice", "step", "0"}), slice(f32({4}), 0, 0, 4, 0)),
      ROW(ShapeError, "slice_dim_out_of_range", (strings{"slice", "dimension 3", "1 dimensions"}), slice(f32({4}), 3, 0, 1)),
      ROW(ShapeError, "expand_incompatible", (strings{"expand", "[3]", "[2, 4]"}), expand(f32({3}), {2, 4})),
      ROW(ShapeError, "expand_minus_one", (strings{"expand", "f32[1, 3]", "[-1, 3]"}), expand(f32({1, 3}), {-1, 3})),
      ROW(ShapeError, "zeros_elements_overflow", (strings{"[4, 4611686018427387904]", "int64"}),
          zeros({4, int64_t(1) << 62})),
      ROW(ShapeError, "zeros_bytes_overflow", (strings{"empty", "[2147483648, 1073741824]", "f64"}),
          zeros({int64_t(1) << 31, int64_t(1) << 30}, DType::f64)),
      ROW(ShapeError, "reshape_known_overflow", (strings{"reshape", "int64", "[-1, 4611686018427387904, 4]"}),
          reshape(f32({2}), {-1, int64_t(1) << 62, 4})),
      ROW(ShapeError, "squeeze_dim_out_of_range", (strings{"squeeze", "dimension 7", "2 dimensions"}), squeeze(f32({2, 3}), 7)),
      ROW(ShapeError, "unsqueeze_dim_out_of_range", (strings{"unsqueeze", "dimension -9"}),
          unsqueeze(f32({2, 3}), -9)),
      ROW(ShapeError, "cat_nothing", (strings{"cat", "no tensors"}), cat({}, 0)),
      ROW(ShapeError, "cat_mismatch", (strings{"cat", "f32[2, 3]", "f32[2, 4]"}), cat({f32({2, 3}), f32({2, 4})}, 0)),
      ROW(DTypeError, "cat_dtype_mismatch", (strings{"cat", "f32[2]", "f64[2]"}),
          cat({f32({2}), zeros({2}, DType::f64)}, 0)),
      ROW(ValueError, "split_zero_size", (strings{"split", "0"}), split(f32({4}), 0, 0)),
      ROW(ShapeError, "flatten_dim_out_of_range", (strings{"flatten", "dimension 4", "2 dimensions"}), flatten(f32({2, 3}), 4)),

      // ---- element-wise and reductions ----
      ROW(ShapeError, "add_not_broadcastable", (strings{"add", "[2, 3]", "[4]"}), add(f32({2, 3}), f32({4}))),
      ROW(ShapeError, "mul_not_broadcastable", (strings{"mul", "[5]", "[3]"}), mul(f32({5}), f32({3}))),
      ROW(DeviceError, "add_across_devices", (strings{"add", "cpu", "cpu:1"}),
          add(f32({2}), zeros({2}, DType::f32, Device("cpu:1")))),
      ROW(DTypeError, "exp_of_integers", (strings{"exp", "i64[3]"}), exp(i64({1, 2, 3}))),
      ROW(ShapeError, "sum_dim_out_of_range", (strings{"sum", "dimension 2", "2 dimensions"}), sum(f32({2, 3}), {2})),
      ROW(ShapeError, "sum_repeated_dim", (strings{"sum", "f32[2, 3]", "repeated"}), sum(f32({2, 3}), {1, 1})),
      ROW(ShapeError, "max_of_empty", (strings{"amax", "f32[0, 3]", "empty"}), prim::amax(f32({0, 3}), {0})),
      ROW(ShapeError, "argmax_of_empty", (strings{"argmax", "f32[0]"}), prim::argmax(f32({0}), 0)),
      ROW(ShapeError, "item_of_empty", (strings{"item", "f32[0]"}), (void)f32({0}).item()),
      ROW(ShapeError, "item_of_many", (strings{"item", "f32[2, 3]"}), (void)f32({2, 3}).item()),
      ROW(ShapeError, "backward_of_non_scalar", (strings{"backward", "f32[2]"}), backward(mul(param({2}), 2.0))),
      ROW(ValueError, "backward_without_grad", (strings{"backward", "f32[]"}), backward(sum(f32({2})))),

      // ---- linear algebra ----
      ROW(ShapeError, "matmul_inner_mismatch", (strings{"matmul", "f32[2, 3]", "f32[4, 5]"}),
          matmul(f32({2, 3}), f32({4, 5}))),
      ROW(ShapeError, "matmul_vector", (strings{"matmul", "f32[3]"}), matmul(f32({3}), f32({3, 2}))),
      ROW(DTypeError, "matmul_dtype_mismatch", (strings{"matmul", "f32[2, 3]", "f64[3, 2]"}),
          matmul(f32({2, 3}), zeros({3, 2}, DType::f64))),
      ROW(DTypeError, "matmul_integers", (strings{"matmul", "i64"}),
          matmul(zeros({2, 2}, DType::i64), zeros({2, 2}, DType::i64))),
      ROW(DeviceError, "matmul_across_devices", (strings{"matmul", "cpu:1"}),
          matmul(f32({2, 2}), zeros({2, 2}, DType::f32, Device("cpu:1")))),
      ROW(ShapeError, "bmm_batch_mismatch", (strings{"bmm", "[2, 3, 4]", "[3, 4, 5]"}),
          bmm(f32({2, 3, 4}), f32({3, 4, 5}))),
      ROW(ShapeError, "linear_in_features_mismatch", (strings{"linear", "f32[8, 5]", "f32[3, 4]"}),
          linear(f32({8, 5}), f32({3, 4}))),
      ROW(ShapeError, "linear_bias_mismatch", (strings{"linear", "f32[2]", "f32[3, 4]"}),
          linear(f32({8, 4}), f32({3, 4}), f32({2}))),
      ROW(ShapeError, "linear_module_wrong_input", (strings{"Linear(5, 3)", "f32[2, 7]"}),
          nn::Linear(5, 3).forward(f32({2, 7}))),

      // ---- losses ----
      ROW(ValueError, "cross_entropy_target_too_large", (strings{"cross_entropy", "index 10", "[0, 10)"}),
          cross_entropy(f32({2, 10}), i64({3, 10}))),
      ROW(ValueError, "cross_entropy_target_negative", (strings{"cross_entropy", "index -2", "[0, 10)"}),
          cross_entropy(f32({2, 10}), i64({-2, 0}))),
      ROW(DTypeError, "cross_entropy_float_target", (strings{"cross_entropy", "f32[2]"}),
          cross_entropy(f32({2, 10}), f32({2}))),
      ROW(ShapeError, "cross_entropy_batch_mismatch", (strings{"cross_entropy", "f32[2, 10]", "i64[3]"}),
          cross_entropy(f32({2, 10}), i64({0, 1, 2}))),
      ROW(ShapeError, "cross_entropy_1d_logits", (strings{"cross_entropy", "f32[10]"}),
          cross_entropy(f32({10}), i64({1}))),
      ROW(DTypeError, "cross_entropy_integer_logits", (strings{"cross_entropy", "i64[2, 3]"}),
          cross_entropy(zeros({2, 3}, DType::i64), i64({0, 1}))),
      ROW(DeviceError, "cross_entropy_across_devices", (strings{"cross_entropy", "cpu:1"}),
          cross_entropy(f32({2, 3}), to(i64({0, 1}), Device("cpu:1")))),
      ROW(ShapeError, "cross_entropy_zero_classes", (strings{"cross_entropy", "f32[2, 0]"}),
          cross_entropy(f32({2, 0}), i64({0, 0}))),
      ROW(ShapeError, "mse_loss_shape_mismatch", (strings{"mse_loss", "f32[3]", "f32[4]"}), mse_loss(f32({3}), f32({4}))),

      // ---- neural-network functions ----
      ROW(ValueError, "embedding_index_too_large", (strings{"embedding", "index 7", "[0, 5)"}),
          embedding(f32({5, 3}), i64({0, 7}))),
      ROW(ValueError, "embedding_index_negative", (strings{"embedding", "index -1", "[0, 5)"}),
          embedding(f32({5, 3}), i64({-1}))),
      ROW(DTypeError, "embedding_float_indices", (strings{"embedding", "f32[2]"}), embedding(f32({5, 3}), f32({2}))),
      ROW(ShapeError, "embedding_1d_weight", (strings{"embedding", "f32[5]"}), embedding(f32({5}), i64({0}))),
      // The raw gathers check CPU indices themselves (their kernels copy rows blindly).
      ROW(ValueError, "index_select_rows_index_too_large", (strings{"index_select_rows", "index 5", "[0, 5)"}),
          prim::index_select_rows(f32({5, 3}), i64({1, 5}))),
      ROW(ValueError, "index_add_rows_index_negative", (strings{"index_add_rows_", "index -1", "[0, 5)"}),
          prim::index_add_rows_(f32({5, 3}), i64({-1}), f32({1, 3}))),
      ROW(ValueError, "embedding_of_empty_table", (strings{"embedding", "index 0", "[0, 0)"}),
          embedding(f32({0, 3}), i64({0}))),
      ROW(ValueError, "embedding_module_index_too_large", (strings{"embedding", "index 12", "[0, 4)"}),
          nn::Embedding(4, 2).forward(i64({12}))),
      ROW(ShapeError, "layer_norm_weight_mismatch", (strings{"layer_norm", "f32[3]", "f32[2, 4]"}),
          layer_norm(f32({2, 4}), f32({3}), Tensor())),
      ROW(ValueError, "layer_norm_negative_eps", (strings{"layer_norm", "eps", "-1"}),
          layer_norm(f32({2, 4}), Tensor(), Tensor(), -1.0)),
      ROW(ValueError, "layer_norm_nan_eps", (strings{"layer_norm", "eps", "nan"}),
          layer_norm(f32({2, 4}), Tensor(), Tensor(), kNaN)),
      ROW(ShapeError, "softmax_dim_out_of_range", (strings{"softmax", "dimension 2", "2 dimensions"}), softmax(f32({2, 3}), 2)),
      ROW(ValueError, "dropout_p_above_one", (strings{"dropout", "1.5"}), dropout(f32({4}), 1.5)),
      ROW(ValueError, "dropout_p_nan", (strings{"dropout", "nan"}), dropout(f32({4}), kNaN)),
      ROW(ShapeError, "conv2d_channel_mismatch", (strings{"conv2d", "[1, 3, 8, 8]", "[4, 2, 3, 3]"}),
          conv2d(f32({1, 3, 8, 8}), f32({4, 2, 3, 3}))),
      ROW(ShapeError, "conv2d_3d_input", (strings{"conv2d", "[3, 8, 8]"}), conv2d(f32({3, 8, 8}), f32({4, 3, 3, 3}))),
      ROW(ShapeError, "conv2d_kernel_too_large", (strings{"conv2d", "[4, 1, 5, 5]", "[1, 1, 3, 3]"}),
          conv2d(f32({1, 1, 3, 3}), f32({4, 1, 5, 5}))),
      ROW(ValueError, "conv2d_zero_stride", (strings{"conv2d", "stride", "0"}),
          conv2d(f32({1, 1, 4, 4}), f32({1, 1, 3, 3}), Tensor(), Conv2dParams{.stride_h = 0})),
      ROW(ValueError, "conv2d_negative_padding", (strings{"conv2d", "pad", "-1"}),
          conv2d(f32({1, 1, 4, 4}), f32({1, 1, 3, 3}), Tensor(), Conv2dParams{.pad_h = -1, .pad_w = -1})),
      ROW(DTypeError, "conv2d_bias_dtype_mismatch", (strings{"conv2d", "f32[4]", "f16[4, 3, 3, 3]"}),
          conv2d(zeros({1, 3, 8, 8}, DType::f16), zeros({4, 3, 3, 3}, DType::f16), f32({4}))),
      ROW(ShapeError, "conv2d_bias_mismatch", (strings{"conv2d", "f32[3]", "[4, 1, 3, 3]"}),
          conv2d(f32({1, 1, 4, 4}), f32({4, 1, 3, 3}), f32({3}))),
      ROW(ShapeError, "max_pool2d_2d_input", (strings{"max_pool2d", "f32[4, 4]"}), max_pool2d(f32({4, 4}))),
      ROW(ShapeError, "max_pool2d_kernel_too_large", (strings{"max_pool2d", "5x5"}),
          max_pool2d(f32({1, 1, 4, 4}), Pool2dParams{5, 5, 1, 1})),
      ROW(ValueError, "max_pool2d_zero_kernel", (strings{"max_pool2d", "kernel", "0"}),
          max_pool2d(f32({1, 1, 4, 4}), Pool2dParams{0, 0, 1, 1})),
      ROW(ValueError, "max_pool2d_padding_over_half_kernel", (strings{"max_pool2d", "pad", "2"}),
          max_pool2d(f32({1, 1, 4, 4}), Pool2dParams{2, 2, 2, 2, 2, 2})),
      ROW(ShapeError, "max_pool2d_empty_image_with_padding", (strings{"max_pool2d", "[1, 1, 0, 4]"}),
          max_pool2d(f32({1, 1, 0, 4}), Pool2dParams{2, 2, 2, 2, 1, 1})),
      ROW(DTypeError, "max_pool2d_backward_i32_indices", (strings{"max_pool2d backward", "i32[1, 1, 2, 2]"}),
          prim::max_pool2d_backward(f32({1, 1, 2, 2}), zeros({1, 1, 2, 2}, DType::i32), {1, 1, 4, 4}, Pool2dParams{})),
      ROW(ShapeError, "max_pool2d_backward_gradient_of_another_shape",
          (strings{"max_pool2d backward", "f32[1, 1, 3, 3]", "[1, 1, 2, 2]"}),
          prim::max_pool2d_backward(f32({1, 1, 3, 3}), zeros({1, 1, 3, 3}, DType::i64), {1, 1, 4, 4}, Pool2dParams{})),
      ROW(ShapeError, "conv2d_backward_data_gradient_of_another_shape",
          (strings{"conv2d backward", "f32[1, 2, 5, 5]", "[1, 2, 2, 2]"}),
          prim::conv2d_backward_data(f32({1, 2, 5, 5}), f32({2, 1, 3, 3}), {1, 1, 4, 4}, {})),
      ROW(ShapeError, "conv2d_backward_weight_gradient_of_another_shape",
          (strings{"conv2d backward", "f32[1, 2, 5, 5]", "[1, 2, 2, 2]"}),
          prim::conv2d_backward_weight(f32({1, 1, 4, 4}), f32({1, 2, 5, 5}), {2, 1, 3, 3}, {})),
      ROW(DeviceError, "index_add_rows_indices_on_another_device", (strings{"index_add_rows_", "cpu:1"}),
          prim::index_add_rows_(f32({5, 3}), prim::to(i64({1}), Device(DeviceType::cpu, 1)), f32({1, 3}))),
      ROW(ShapeError, "cat_of_scalars", (strings{"cat", "0 dimensions"}),
          prim::cat({scalar_tensor(1.0), scalar_tensor(2.0)}, 0)),
      ROW(ShapeError, "slice_of_a_scalar", (strings{"slice", "0 dimensions"}), prim::slice(scalar_tensor(1.0), 0, 0, 1)),
      ROW(ShapeError, "split_of_a_scalar", (strings{"split", "0 dimensions"}), split(scalar_tensor(1.0), 1, 0)),
      ROW(ShapeError, "size_of_a_scalar", (strings{"size", "0 dimensions"}), scalar_tensor(1.0).size(0)),
      ROW(ShapeError, "attention_shape_mismatch", (strings{"attention", "[1, 2, 4, 8]", "[1, 2, 5, 8]"}),
          scaled_dot_product_attention(f32({1, 2, 4, 8}), f32({1, 2, 5, 8}), f32({1, 2, 4, 8}))),
      ROW(ShapeError, "attention_3d", (strings{"attention", "[2, 4, 8]"}),
          scaled_dot_product_attention(f32({2, 4, 8}), f32({2, 4, 8}), f32({2, 4, 8}))),
      ROW(ShapeError, "bce_target_of_another_shape",
          (strings{"binary_cross_entropy_with_logits", "f32[4, 3]", "f32[4, 2]"}),
          binary_cross_entropy_with_logits(f32({4, 3}), f32({4, 2}))),
      ROW(ShapeError, "bce_pos_weight_of_another_size",
          (strings{"binary_cross_entropy_with_logits", "pos_weight", "f32[2]", "f32[4, 3]"}),
          binary_cross_entropy_with_logits(f32({4, 3}), f32({4, 3}), Reduction::mean, f32({2}))),
      ROW(DTypeError, "bce_integer_target", (strings{"binary_cross_entropy_with_logits", "i64[4, 3]"}),
          binary_cross_entropy_with_logits(f32({4, 3}), prim::to(f32({4, 3}), DType::i64))),
      ROW(ShapeError, "attention_mask_of_another_shape",
          (strings{"attention", "attn_mask", "f32[4, 5]", "[1, 2, 4, 6]"}),
          scaled_dot_product_attention(f32({1, 2, 4, 8}), f32({1, 2, 6, 8}), f32({1, 2, 6, 8}), false, std::nullopt,
                                       f32({4, 5}))),
      ROW(DTypeError, "attention_mask_of_i64", (strings{"attention", "attn_mask", "i64[4, 4]", "u8"}),
          scaled_dot_product_attention(f32({1, 2, 4, 8}), f32({1, 2, 4, 8}), f32({1, 2, 4, 8}), true, std::nullopt,
                                       prim::to(f32({4, 4}), DType::i64))),
      ROW(DeviceError, "attention_mask_on_another_device", (strings{"attention", "cpu:1"}),
          scaled_dot_product_attention(f32({1, 2, 4, 8}), f32({1, 2, 4, 8}), f32({1, 2, 4, 8}), true, std::nullopt,
                                       prim::to(f32({4, 4}), Device(DeviceType::cpu, 1)))),
      ROW(ShapeError, "attention_head_widths_differ", (strings{"attention", "[1, 2, 4, 8]", "[1, 2, 4, 4]"}),
          scaled_dot_product_attention(f32({1, 2, 4, 8}), f32({1, 2, 4, 4}), f32({1, 2, 4, 4}))),
      ROW(ShapeError, "attention_causal_with_more_queries_than_keys",
          (strings{"attention", "causal", "[1, 2, 5, 8]", "[1, 2, 4, 8]"}),
          scaled_dot_product_attention(f32({1, 2, 5, 8}), f32({1, 2, 4, 8}), f32({1, 2, 4, 8}), true)),

      // ---- modules and models ----
      ROW(ValueError, "linear_zero_features", (strings{"Linear", "0"}), nn::Linear(0, 3)),
      ROW(ValueError, "embedding_negative_size", (strings{"Embedding", "-4"}), nn::Embedding(-4, 2)),
      ROW(ValueError, "layer_norm_zero_width", (strings{"LayerNorm", "0"}), nn::LayerNorm(0)),
      ROW(ValueError, "batch_norm_zero_features", (strings{"BatchNorm2d", "num_features", "0"}), nn::BatchNorm2d(0)),
      ROW(ValueError, "batch_norm_momentum_above_one", (strings{"BatchNorm1d", "momentum", "1.5"}),
          nn::BatchNorm1d(3, {.momentum = 1.5})),
      ROW(ShapeError, "batch_norm2d_wrong_channels", (strings{"BatchNorm2d(3)", "f32[2, 4, 5, 5]", "[N, 3, H, W]"}),
          nn::BatchNorm2d(3).forward(f32({2, 4, 5, 5}))),
      ROW(ShapeError, "batch_norm1d_wrong_rank", (strings{"BatchNorm1d(3)", "f32[2, 3, 4, 4]", "[N, 3, L]"}),
          nn::BatchNorm1d(3).forward(f32({2, 3, 4, 4}))),
      ROW(ShapeError, "batch_norm_one_value_per_channel_in_training",
          (strings{"batch_norm", "more than one value per channel", "f32[1, 3]"}),
          nn::BatchNorm1d(3).forward(f32({1, 3}))),
      ROW(ShapeError, "batch_norm_weight_of_another_size", (strings{"batch_norm", "weight", "f32[4]", "f32[2, 3]"}),
          batch_norm(f32({2, 3}), Tensor(), Tensor(), f32({4}), Tensor(), true)),
      ROW(ValueError, "batch_norm_eval_without_running_statistics", (strings{"batch_norm", "running statistics"}),
          batch_norm(f32({2, 3}), Tensor(), Tensor(), Tensor(), Tensor(), false)),
      ROW(DTypeError, "batch_norm_integer_input", (strings{"batch_norm", "i64[2, 3]"}),
          batch_norm(prim::to(f32({2, 3}), DType::i64), Tensor(), Tensor(), Tensor(), Tensor(), true)),
      ROW(ValueError, "conv2d_zero_kernel", (strings{"Conv2d", "kernel", "0"}), nn::Conv2d(1, 2, 0)),
      ROW(ShapeError, "mlp_wrong_input_width", (strings{"Linear(10, 8)", "f32[4, 100]"}),
          nn::make_mlp({.in_features = 10, .hidden = {8}, .num_classes = 3})->forward(f32({4, 100}))),
      ROW(ValueError, "gpt_heads_do_not_divide_width", (strings{"GPTBlock", "d_model 10", "n_heads 3"}),
          nn::GPT({.vocab_size = 5, .context = 4, .d_model = 10, .n_layers = 1, .n_heads = 3})),
      ROW(ShapeError, "gpt_sequence_over_context", (strings{"GPT", "i64[1, 5]", "context 4"}),
          nn::GPT({.vocab_size = 5, .context = 4, .d_model = 8, .n_layers = 1, .n_heads = 2})
              .forward(zeros({1, 5}, DType::i64))),
      ROW(ValueError, "gpt_token_out_of_vocabulary", (strings{"embedding", "index 9", "[0, 5)"}),
          nn::GPT({.vocab_size = 5, .context = 4, .d_model = 8, .n_layers = 1, .n_heads = 2})
              .forward(full({1, 2}, 9, DType::i64))),

      // ---- optimizers and schedules ----
      ROW(ValueError, "sgd_negative_lr", (strings{"SGD", "learning rate", "-0.1"}), optim::SGD({param({2})}, {.lr = -0.1})),
      ROW(ValueError, "sgd_nan_lr", (strings{"SGD", "learning rate", "nan"}), optim::SGD({param({2})}, {.lr = kNaN})),
      ROW(ValueError, "sgd_negative_momentum", (strings{"SGD", "momentum", "-1"}),
          optim::SGD({param({2})}, {.momentum = -1})),
      ROW(ValueError, "sgd_nesterov_without_momentum", (strings{"SGD", "nesterov"}),
          optim::SGD({param({2})}, {.nesterov = true})),
      ROW(ValueError, "sgd_negative_weight_decay", (strings{"SGD", "weight_decay", "-1"}),
          optim::SGD({param({2})}, {.weight_decay = -1})),
      ROW(ValueError, "adamw_negative_lr", (strings{"AdamW", "learning rate", "-0.001"}),
          optim::AdamW({param({2})}, {.lr = -0.001})),
      ROW(ValueError, "adamw_beta1_one", (strings{"AdamW", "beta1", "1"}), optim::AdamW({param({2})}, {.beta1 = 1.0})),
      ROW(ValueError, "adamw_beta2_negative", (strings{"AdamW", "beta2", "-0.5"}),
          optim::AdamW({param({2})}, {.beta2 = -0.5})),
      ROW(ValueError, "adamw_nan_beta2", (strings{"AdamW", "beta2", "nan"}), optim::AdamW({param({2})}, {.beta2 = kNaN})),
      ROW(ValueError, "adamw_negative_eps", (strings{"AdamW", "eps", "-1"}), optim::AdamW({param({2})}, {.eps = -1})),
      ROW(ValueError, "adamw_nan_weight_decay", (strings{"AdamW", "weight_decay", "nan"}),
          optim::AdamW({param({2})}, {.weight_decay = kNaN})),
      ROW(ValueError, "optimizer_without_parameters", (strings{"AdamW", "parameter group 0 is empty"}), optim::AdamW(std::vector<Tensor>{})),
      ROW(DTypeError, "optimizer_integer_parameter", (strings{"SGD", "i64[2]"}),
          optim::SGD({zeros({2}, DType::i64)}, {})),
      ROW(DeviceError, "optimizer_state_left_on_another_device", (strings{"AdamW", "exp_avg", "weight", "cpu:1"}), {
        auto layer = std::make_shared<nn::Linear>(2, 2);
        optim::AdamW adamw(layer->parameters());
        backward(sum(layer->forward(f32({1, 2}))));
        adamw.step();  // its moments are made on cpu:0
        const Device other(DeviceType::cpu, 1);
        layer->to(other);
        backward(sum(layer->forward(zeros({1, 2}, DType::f32, other))));
        adamw.step();
      }),
      ROW(ValueError, "set_lr_negative", (strings{"SGD", "learning rate", "-1"}), optim::SGD({param({2})}, {}).set_lr(-1.0)),
      ROW(ValueError, "set_lr_nan", (strings{"SGD", "learning rate", "nan"}), optim::SGD({param({2})}, {}).set_lr(kNaN)),
      ROW(ValueError, "cosine_warmup_over_total", (strings{"LrSchedule::cosine", "warmup_steps 10", "total_steps 5"}),
          optim::LrSchedule::cosine(0.1, 10, 5)),
      ROW(ValueError, "cosine_min_lr_over_lr", (strings{"cosine", "min_lr", "0.5"}),
          optim::LrSchedule::cosine(0.1, 0, 100, 0.5)),
      ROW(ValueError, "cosine_nan_lr", (strings{"LrSchedule::cosine", "learning rate nan"}),
          optim::LrSchedule::cosine(kNaN, 0, 100)),
      ROW(ValueError, "constant_negative_lr", (strings{"LrSchedule::constant", "learning rate -1"}), optim::LrSchedule::constant(-1.0)),
      ROW(ValueError, "clip_grad_negative_max_norm", (strings{"clip_grad_norm_", "max_norm", "-1"}),
          nn::clip_grad_norm_({param({2})}, -1.0)),
      ROW(ValueError, "clip_grad_nan_max_norm", (strings{"clip_grad_norm_", "max_norm", "nan"}),
          nn::clip_grad_norm_({param({2})}, kNaN)),
      ROW(ValueError, "clip_grad_bad_norm_type", (strings{"clip_grad_norm_", "norm_type", "0"}),
          nn::clip_grad_norm_({param({2})}, 1.0, 0.0)),

      // ---- loss scaling ----
      ROW(ValueError, "scaler_growth_factor_one", (strings{"GradScaler", "growth_factor", "1"}),
          amp::GradScaler({.growth_factor = 1.0})),
      ROW(ValueError, "scaler_growth_factor_below_one", (strings{"GradScaler", "growth_factor", "0.5"}),
          amp::GradScaler({.growth_factor = 0.5})),
      ROW(ValueError, "scaler_growth_factor_nan", (strings{"GradScaler", "growth_factor", "nan"}),
          amp::GradScaler({.growth_factor = kNaN})),
      ROW(ValueError, "scaler_backoff_factor_one", (strings{"GradScaler", "backoff_factor", "1"}),
          amp::GradScaler({.backoff_factor = 1.0})),
      ROW(ValueError, "scaler_backoff_factor_zero", (strings{"GradScaler", "backoff_factor", "0"}),
          amp::GradScaler({.backoff_factor = 0.0})),
      ROW(ValueError, "scaler_backoff_factor_nan", (strings{"GradScaler", "backoff_factor", "nan"}),
          amp::GradScaler({.backoff_factor = kNaN})),
      ROW(ValueError, "scaler_negative_init_scale", (strings{"GradScaler", "init_scale", "-1"}),
          amp::GradScaler({.init_scale = -1})),
      ROW(ValueError, "scaler_infinite_init_scale", (strings{"GradScaler", "init_scale", "inf"}),
          amp::GradScaler({.init_scale = INFINITY})),
      ROW(ValueError, "scaler_nan_init_scale", (strings{"GradScaler", "init_scale", "nan"}),
          amp::GradScaler({.init_scale = kNaN})),
      ROW(ValueError, "scaler_nan_min_scale", (strings{"GradScaler", "min_scale", "nan"}),
          amp::GradScaler({.min_scale = kNaN})),
      ROW(ValueError, "scaler_zero_growth_interval", (strings{"GradScaler", "growth_interval", "0"}),
          amp::GradScaler({.growth_interval = 0})),
      ROW(ValueError, "scaler_zero_hysteresis", (strings{"GradScaler", "hysteresis", "0"}),
          amp::GradScaler({.hysteresis = 0})),
      ROW(ValueError, "scaler_min_over_max", (strings{"GradScaler", "min_scale 8", "max_scale 4"}),
          amp::GradScaler({.min_scale = 8, .max_scale = 4})),
      ROW(ValueError, "scaler_unknown_policy", (strings{"GradScaler", "wobbly"}), amp::scale_policy_from_name("wobbly")),
      ROW(DTypeError, "scaler_integer_loss", (strings{"GradScaler::scale", "i64[]"}),
          amp::GradScaler().scale(zeros({}, DType::i64))),
      ROW(ValueError, "add_undefined_operand", (strings{"add", "undefined"}), add(f32({2}), Tensor())),
      ROW(ValueError, "matmul_undefined_operand", (strings{"matmul", "undefined"}), prim::matmul(Tensor(), f32({2, 2}))),
      ROW(ValueError, "exp_undefined_operand", (strings{"exp", "undefined"}), exp(Tensor())),
      ROW(ValueError, "linear_undefined_weight", (strings{"linear", "undefined"}), linear(f32({2, 3}), Tensor())),
      ROW(ValueError, "cross_entropy_undefined_target", (strings{"cross_entropy", "undefined"}),
          cross_entropy(f32({2, 3}), Tensor())),
      ROW(ValueError, "conv2d_undefined_input", (strings{"conv2d", "undefined"}),
          conv2d(Tensor(), f32({4, 1, 3, 3}), Tensor(), {})),
      ROW(ValueError, "reshape_undefined_input", (strings{"reshape", "undefined"}), reshape(Tensor(), {2, 3})),
      ROW(ValueError, "transpose_undefined_input", (strings{"transpose", "undefined"}), transpose(Tensor(), 0, 1)),
      ROW(ValueError, "slice_undefined_input", (strings{"slice", "undefined"}), slice(Tensor(), 0, 0, 1)),
      ROW(ValueError, "cat_undefined_input", (strings{"cat", "undefined"}), cat({Tensor(), f32({2})}, 0)),
      ROW(ValueError, "to_undefined_input", (strings{"to", "undefined"}), to(Tensor(), DType::f16)),
      ROW(ValueError, "copy_undefined_source", (strings{"copy_", "undefined"}), prim::copy_(f32({2}), Tensor())),
      ROW(ValueError, "scaler_undefined_loss", (strings{"GradScaler::scale", "undefined"}), amp::GradScaler().scale(Tensor())),
      ROW(ValueError, "scaler_negative_samples", (strings{"GradScaler::scale", "samples", "-3"}),
          amp::GradScaler().scale(f32({}), -3)),
      ROW(ValueError, "scaler_zero_batch_counted_in_samples", (strings{"GradScaler::scale", "samples"}),
          amp::GradScaler({.growth_unit = amp::GrowthUnit::samples}).scale(f32({}), 0)),
      ROW(DeviceError, "backward_gradient_on_another_device", (strings{"backward", "f32[2] on cpu and", "on cpu:1"}), {
        const Tensor w = ones({2}, DType::f32, Device(DeviceType::cpu, 1)).set_requires_grad(true);
        backward(mul(w, w), ones({2}));
      }),
      ROW(DTypeError, "backward_integer_gradient", (strings{"backward", "i64[2]"}), {
        const Tensor w = ones({2}).set_requires_grad(true);
        backward(mul(w, w), i64({1, 1}));
      }),
      ROW(DTypeError, "scaler_f16_gradients", (strings{"GradScaler::unscale_", "f16[3]", "f32"}), {
        Tensor w = zeros({3}, DType::f16).set_requires_grad(true);
        amp::GradScaler scaler;
        scaler.scale(f32({}));
        backward(sum(w));
        optim::SGD sgd({w}, {});
        scaler.unscale_(sgd);
      }),
      ROW(ValueError, "scaler_update_before_scale", (strings{"GradScaler", "update"}), amp::GradScaler().update()),

      // ---- data ----
      ROW(ValueError, "sampler_negative_size", (strings{"SequentialOrRandomSampler", "-1"}),
          data::SequentialOrRandomSampler(-1, false)),
      ROW(ValueError, "distributed_sampler_rank_out_of_range", (strings{"DistributedSampler", "rank 2", "[0, 2)"}),
          data::DistributedSampler(10, 2, 2)),
      ROW(ValueError, "distributed_sampler_empty_data_set", (strings{"DistributedSampler", "size 0"}),
          data::DistributedSampler(0, 2, 0)),
      ROW(ValueError, "distributed_sampler_zero_world", (strings{"DistributedSampler", "world", "0"}),
          data::DistributedSampler(10, 0, 0)),
      ROW(ValueError, "char_dataset_zero_context", (strings{"CharDataset", "context", "0"}),
          data::CharDataset(std::string("hello world"), 0, "text")),
      ROW(IOError, "char_dataset_text_shorter_than_context", (strings{"CharDataset", "11 bytes", "context of 64"}),
          data::CharDataset(std::string("hello world"), 64, "text")),
      ROW(ValueError, "char_dataset_index_out_of_range", (strings{"CharDataset", "100"}),
          data::CharDataset(std::string("hello world"), 4, "text").get_batch({100})),
      ROW(ValueError, "data_loader_zero_batch", (strings{"DataLoader", "batch_size", "0"}),
          data::DataLoader(std::make_shared<data::CharDataset>(std::string("hello world"), 4, "text"),
                           std::make_shared<data::SequentialOrRandomSampler>(7, false), {.batch_size = 0})),
      ROW(ValueError, "data_loader_negative_workers", (strings{"DataLoader", "num_workers", "-1"}),
          data::DataLoader(std::make_shared<data::CharDataset>(std::string("hello world"), 4, "text"),
                           std::make_shared<data::SequentialOrRandomSampler>(7, false),
                           {.batch_size = 2, .num_workers = -1})),
      ROW(IOError, "char_dataset_missing_file", (strings{"CharDataset", "/nonexistent/text.txt"}),
          data::CharDataset("/nonexistent/text.txt", 8)),

      // ---- devices ----
      ROW(DeviceError, "device_unknown_type", (strings{"tpu:0"}), Device("tpu:0")),
      ROW(DeviceError, "device_negative_index", (strings{"cuda:-1"}), Device("cuda:-1")),
      ROW(Error, "device_cuda_that_does_not_exist", (strings{"cuda:97"}), zeros({2}, DType::f32, Device("cuda:97"))),
  };
}

// gtest prints a row by its name.
void PrintTo(const BadInput& r, std::ostream* os) { *os << r.name; }

class BadInputTest : public ::testing::TestWithParam<BadInput> {};

void expect_clear_error(const BadInput& r) {
  try {
    r.call();
    ADD_FAILURE() << r.name << ": accepted without an error";
  } catch (const Error& e) {
    EXPECT_TRUE(r.is_expected(e)) << r.name << ": expected " << r.expected_type << ", got " << typeid(e).name()
                                  << ": " << e.what();
    expect_contains(e.what(), r.message_parts);
  } catch (const std::exception& e) {
    ADD_FAILURE() << r.name << ": raised a " << typeid(e).name() << " instead of an mpt::Error: " << e.what();
  }
}

TEST_P(BadInputTest, RaisesAClearError) { expect_clear_error(GetParam()); }

// The same rows with oneDNN taking every CPU product it can, where the
// build has it: the checks come before any backend, so bad input never
// reaches oneDNN and the errors are the same.
TEST_P(BadInputTest, RaisesTheSameErrorWithOnednnOnEveryProduct) {
  std::string why;
  if (!cpu_onednn_usable(&why)) GTEST_SKIP() << "skipped: " << why;
  struct Restore {
    CpuOnednn before = cpu_onednn();
    ~Restore() { set_cpu_onednn(before); }
  } restore;
  set_cpu_onednn(CpuOnednn::kAlways);
  expect_clear_error(GetParam());
}

INSTANTIATE_TEST_SUITE_P(PublicApi, BadInputTest, ::testing::ValuesIn(table()),
                         [](const ::testing::TestParamInfo<BadInput>& info) { return info.param.name; });

}  // namespace
