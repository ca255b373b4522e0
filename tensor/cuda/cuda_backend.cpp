// The CUDA backend: checks what the kernels rely on, describes operands as
// collapsed strided layouts, and hands over to the launchers (kernels.h).
#include "tensor/cuda/cuda_backend.h"

#include <algorithm>
#include <array>
#include <cstring>

#include <fmt/format.h>

#include "tensor/cuda/attention.h"
#include "tensor/cuda/attention_cudnn.h"
#include "tensor/cuda/batch_norm.h"
#include "tensor/cuda/caching_allocator.h"
#include "tensor/cuda/check.h"
#include "tensor/cuda/cross_entropy.h"
#include "tensor/cuda/fp8_quantize.h"
#include "tensor/cuda/layer_norm.h"
#include "tensor/cuda/conv_cudnn.h"
#include "tensor/cuda/copy_list.h"
#include "tensor/cuda/gemm.h"
#include "tensor/cuda/kernels.h"
#include "tensor/cuda/runtime.h"
#include "tensor/device_guard.h"
#include "tensor/error.h"
#include "tensor/fp8.h"
#include "tensor/half.h"

namespace mpt {
namespace cuda {

void throw_dtype_unsupported(const char* op, DType dtype) {
  throw DTypeError(fmt::format("CUDA {}: dtype {} is not supported", op, dtype_name(dtype)));
}

namespace {

Launch current_launch() {
  Launch l;
  l.device = current_device();
  l.stream = current_cuda_stream(l.device);
  l.sm_count = multiprocessor_count(l.device);
  return l;
}

// (Written out only when a failing check formats it: collapse() and the
// other checks below run on every launch.)
ShapeDescription shape_of(const TensorView& v) { return ShapeDescription(v.shape, static_cast<size_t>(v.ndim)); }

// Describes N same-shaped views (views[0] the output) as one strided walk:
// size-1 dimensions dropped, and neighbouring dimensions merged wherever
// every operand steps through them as through one (so contiguous operands
// become a single dimension of stride 1).
template <int N>
Strided<N> collapse(const std::array<const TensorView*, N>& views, const char* op) {
  const TensorView& out = *views[0];
  for (int n = 1; n < N; ++n) {
    const TensorView& v = *views[n];
    bool same = v.ndim == out.ndim;
    for (int d = 0; same && d < out.ndim; ++d) same = v.shape[d] == out.shape[d];
    check<ShapeError>(same, "CUDA {}: operand of shape {} does not match the output's shape {}", op, shape_of(v),
                      shape_of(out));
  }
  Strided<N> s;
  for (int n = 0; n < N; ++n) s.data[n] = views[n]->data;
  for (int d = out.ndim - 1; d >= 0; --d) {  // innermost first
    if (out.shape[d] == 1) continue;
    if (s.ndim > 0) {
      const int last = s.ndim - 1;
      bool mergeable = true;
      for (int n = 0; n < N; ++n) mergeable &= views[n]->strides[d] == s.strides[n][last] * s.shape[last];
      if (mergeable) {
        s.shape[last] *= out.shape[d];
        continue;
      }
    }
    s.shape[s.ndim] = out.shape[d];
    for (int n = 0; n < N; ++n) s.strides[n][s.ndim] = views[n]->strides[d];
    ++s.ndim;
  }
  if (s.ndim == 0) {  // a single element
    s.ndim = 1;
    s.shape[0] = 1;
    for (int n = 0; n < N; ++n) s.strides[n][0] = 1;
  }
  s.prepare_divisors();
  return s;
}

bool is_float(DType t) { return t == DType::f32 || t == DType::f16 || t == DType::bf16 || t == DType::f64; }

void check_float(const char* what, const char* op, DType t) {
  check<DTypeError>(is_float(t), "CUDA {} {}: dtype {} is not supported (f32, f16, bf16, f64)", what, op,
                    dtype_name(t));
}

void check_same_dtype(const char* what, const char* op, const TensorView& out, const TensorView& in) {
  check<DTypeError>(out.dtype == in.dtype, "CUDA {} {}: operand dtype {} differs from the output's {}", what, op,
                    dtype_name(in.dtype), dtype_name(out.dtype));
}

void check_contiguous(const char* op, const TensorView& v) {
  check<ShapeError>(v.is_contiguous(), "CUDA {}: needs a contiguous tensor (shape {})", op, shape_of(v));
}

// `value` as the bit pattern of one element of `t`, converted as the CPU does.
uint64_t element_bits(double value, DType t) {
  switch (t) {
    case DType::f32: return float_bits(static_cast<float>(value));
    case DType::f16: return Half(value).bits;
    case DType::bf16: return BFloat16(value).bits;
    case DType::f64: {
      uint64_t u;
      std::memcpy(&u, &value, 8);
      return u;
    }
    case DType::i32: return static_cast<uint32_t>(static_cast<int32_t>(value));
    case DType::i64: return static_cast<uint64_t>(static_cast<int64_t>(value));
    case DType::u8: return static_cast<uint8_t>(value);
    case DType::e4m3: return Float8E4M3(value).bits;
    case DType::e5m2: return Float8E5M2(value).bits;
  }
  throw_dtype_unsupported("fill", t);
}

// Device memory a call's launches need while they run, from the caching
// allocator: given back when the call returns, on the stream it was taken
// for, so its next user is ordered after these launches.
class LaunchScratch {
 public:
  LaunchScratch(const Launch& l, size_t bytes)
      : allocator_(caching_allocator(l.device)), ptr_(allocator_.allocate(bytes, l.stream)) {}
  ~LaunchScratch() { allocator_.free(ptr_); }
  LaunchScratch(const LaunchScratch&) = delete;
  LaunchScratch& operator=(const LaunchScratch&) = delete;
  void* get() const { return ptr_; }

 private:
  CachingAllocator& allocator_;
  void* ptr_;
};

class CudaBackend final : public Backend {
 public:
  void fill(const TensorView& out, double value) override {
    const int64_t n = out.numel();
    if (n == 0) return;
    const Launch l = current_launch();
    const Strided<1> s = collapse<1>({&out}, "fill");
    const uint64_t bits = element_bits(value, out.dtype);
    const size_t size = dtype_size(out.dtype);
    if (s.contiguous() && (bits == 0 || size == 1)) {
      MPT_CUDA_CHECK(cudaMemsetAsync(out.data, static_cast<int>(bits), static_cast<size_t>(n) * size, l.stream));
      return;
    }
    launch_fill(l, s, size, bits, n);
  }

  void copy(const TensorView& dst, const TensorView& src) override {
    // Nothing to do for no elements, and collapse() would divide by a size of 0.
    const int64_t n = dst.numel();
    if (n == 0) return;
    const Strided<2> s = collapse<2>({&dst, &src}, "copy");
    const Launch l = current_launch();
    if (dst.dtype == src.dtype && s.contiguous()) {
      if (dst.data != src.data)
        MPT_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, static_cast<size_t>(n) * dtype_size(dst.dtype),
                                       cudaMemcpyDeviceToDevice, l.stream));
      return;
    }
    launch_copy(l, dst.dtype, src.dtype, s, n);
  }

  void unary(UnaryOp op, const TensorView& out, const TensorView& in, double alpha, double beta) override {
    check_float("unary", unary_op_name(op), out.dtype);
    check_same_dtype("unary", unary_op_name(op), out, in);
    const int64_t n = out.numel();
    if (n == 0) return;
    const Strided<2> s = collapse<2>({&out, &in}, unary_op_name(op));
    launch_unary(current_launch(), op, out.dtype, s, n, alpha, beta);
  }

  bool binary_takes_mixed(DType out, DType a, DType b) const override {
    return binary_wide_supported(out, a, b);
  }

  void binary(BinaryOp op, const TensorView& out, const TensorView& a, const TensorView& b) override {
    check_float("binary", binary_op_name(op), out.dtype);
    const bool wide = binary_wide_supported(out.dtype, a.dtype, b.dtype);
    if (!wide) {
      check_same_dtype("binary", binary_op_name(op), out, a);
      check_same_dtype("binary", binary_op_name(op), out, b);
    }
    const int64_t n = out.numel();
    if (n == 0) return;
    const Strided<3> s = collapse<3>({&out, &a, &b}, binary_op_name(op));
    if (wide) return launch_binary_wide(current_launch(), op, a.dtype, b.dtype, s, n);
    launch_binary(current_launch(), op, out.dtype, s, n);
  }

  void reduce(ReduceOp op, const TensorView& out, const TensorView& in, int64_t outer, int64_t k,
              int64_t inner) override {
    const char* name = reduce_op_name(op);
    const DType t = in.dtype;
    check_float("reduce", name, t);
    const DType want = op == ReduceOp::argmax ? DType::i64 : t;
    check<DTypeError>(out.dtype == want, "CUDA reduce {}: output dtype {} should be {}", name, dtype_name(out.dtype),
                      dtype_name(want));
    check_contiguous(name, in);
    check_contiguous(name, out);
    check<ShapeError>(outer >= 0 && k >= 0 && inner >= 0 && in.numel() == outer * k * inner &&
                          out.numel() == outer * inner,
                      "CUDA reduce {}: [outer {}, k {}, inner {}] does not fit input {} and output {}", name, outer,
                      k, inner, shape_of(in), shape_of(out));
    launch_reduce(current_launch(), op, t, in.data, out.data, outer, k, inner);
  }

  void gemm(const GemmArgs& args) override { cuda::gemm(args); }

  void uniform(const TensorView& out, uint64_t seed, uint64_t offset, double low, double high) override {
    random(out, seed, offset, false, low, high, "uniform");
  }

  void normal(const TensorView& out, uint64_t seed, uint64_t offset, double mean, double stddev) override {
    random(out, seed, offset, true, mean, stddev, "normal");
  }

  void arange(const TensorView& out, double start, double step) override {
    check_contiguous("arange", out);
    const int64_t n = out.numel();
    if (n == 0) return;
    launch_arange(current_launch(), out.data, out.dtype, n, start, step);
  }

  void index_select_rows(const TensorView& out, const TensorView& table, const TensorView& idx) override {
    check_rows("index_select_rows", out, table, idx);
    check_same_dtype("gather", "index_select_rows", out, table);
    launch_gather_rows(current_launch(), out.data, table.data, static_cast<const int64_t*>(idx.data),
                       dtype_size(table.dtype), table.shape[0], idx.shape[0], table.shape[1]);
  }

  void index_add_rows(const TensorView& table, const TensorView& idx, const TensorView& src) override {
    check_rows("index_add_rows", src, table, idx);
    check_float("scatter", "index_add_rows", table.dtype);
    check_same_dtype("scatter", "index_add_rows", table, src);
    const Launch l = current_launch();
    const int64_t rows = table.shape[0], n = idx.shape[0], d = table.shape[1];
    const LaunchScratch scratch(l, scatter_add_rows_scratch_bytes(table.dtype, rows, n, d));
    launch_scatter_add_rows(l, table.dtype, table.data, static_cast<const int64_t*>(idx.data), src.data, rows, n, d,
                            scratch.get());
  }

  void conv2d_forward(const TensorView& out, const TensorView& x, const TensorView& w,
                      const Conv2dParams& p) override {
    check_conv("conv2d", {&out, &x, &w});
    cuda::conv2d_forward(out, x, w, p);
  }

  void conv2d_backward_data(const TensorView& grad_x, const TensorView& grad_out, const TensorView& w,
                            const Conv2dParams& p) override {
    check_conv("conv2d backward data", {&grad_x, &grad_out, &w});
    cuda::conv2d_backward_data(grad_x, grad_out, w, p);
  }

  void conv2d_backward_weight(const TensorView& grad_w, const TensorView& x, const TensorView& grad_out,
                              const Conv2dParams& p) override {
    check_conv("conv2d backward weight", {&grad_w, &x, &grad_out});
    cuda::conv2d_backward_weight(grad_w, x, grad_out, p);
  }

  void max_pool2d_forward(const TensorView& out, const TensorView& indices, const TensorView& x,
                          const Pool2dParams& p) override {
    check_pool("max_pool2d", out, indices, x);
    launch_max_pool2d_forward(current_launch(), x.dtype, out.data, static_cast<int64_t*>(indices.data), x.data,
                              x.shape, out.shape[2], out.shape[3], p);
  }

  void max_pool2d_backward(const TensorView& grad_x, const TensorView& grad_out, const TensorView& indices,
                           const Pool2dParams& p) override {
    check_pool("max_pool2d backward", grad_out, indices, grad_x);
    launch_max_pool2d_backward(current_launch(), grad_x.dtype, grad_x.data, grad_out.data,
                               static_cast<const int64_t*>(indices.data), grad_x.shape, grad_out.shape[2],
                               grad_out.shape[3], p);
  }

  bool fused_layer_norm_supported(DType dtype, DType out_dtype, int64_t d) const override {
    return cuda::fused_layer_norm_supported(dtype, out_dtype, d);
  }

  void layer_norm_forward(const TensorView& out, const TensorView& mean, const TensorView& rstd,
                          const TensorView& x, const TensorView& weight, const TensorView& bias,
                          double eps) override {
    const LayerNormArgs a = layer_norm_args(x, out.dtype, weight, bias, mean, rstd, eps);
    check<ShapeError>(out.numel() == x.numel(), "CUDA layer_norm: output {} does not match input {}", shape_of(out),
                      shape_of(x));
    check_contiguous("layer_norm", out);
    launch_layer_norm_forward(current_launch(), a, out.data);
  }

  void layer_norm_backward(const TensorView& grad_x, const TensorView& grad_x_narrow, const TensorView& grad_weight,
                           const TensorView& grad_bias, const TensorView& grad_out, const TensorView& grad_x_more,
                           const TensorView& x, const TensorView& weight, const TensorView& mean,
                           const TensorView& rstd) override {
    const LayerNormArgs a = layer_norm_args(x, grad_out.dtype, weight, TensorView{}, mean, rstd, 0.0);
    check_same_dtype("layer_norm", "backward", x, grad_x);
    if (grad_x_more.data) check_same_dtype("layer_norm", "backward", x, grad_x_more);
    if (grad_x_narrow.data) {
      check<DTypeError>(x.dtype == DType::f32 && grad_out.dtype != DType::f32,
                        "CUDA layer_norm backward: a narrow copy of the gradient needs f32 x and a 16-bit gradient, "
                        "got x {} and gradient {}",
                        dtype_name(x.dtype), dtype_name(grad_out.dtype));
      check_same_dtype("layer_norm", "backward", grad_out, grad_x_narrow);
    }
    for (const TensorView* t : {&grad_x, &grad_x_narrow, &grad_out, &grad_x_more}) {
      if (!t->data) continue;
      check<ShapeError>(t->numel() == x.numel(), "CUDA layer_norm backward: {} does not match input {}",
                        shape_of(*t), shape_of(x));
      check_contiguous("layer_norm backward", *t);
    }
    for (const TensorView* t : {&grad_weight, &grad_bias})
      check<ShapeError>(!t->data || (t->dtype == DType::f32 && t->numel() == a.d && t->is_contiguous()),
                        "CUDA layer_norm backward: parameter gradients must be contiguous f32 [{}]", a.d);
    if (a.rows == 0) {  // no rows: the parameter gradients are sums over nothing
      for (const TensorView* t : {&grad_weight, &grad_bias})
        if (t->data) fill(*t, 0.0);
      return;
    }
    const Launch l = current_launch();
    // One row of column sums per block for each parameter, then one launch adds them up.
    const size_t bytes = static_cast<size_t>(layer_norm_backward_partials(l, a) * a.d) * sizeof(float);
    const LaunchScratch partials(l, 2 * bytes);
    float* partial_w = static_cast<float*>(partials.get());
    float* partial_b = partial_w + bytes / sizeof(float);
    launch_layer_norm_backward(l, a, grad_out.data, grad_x_more.data, grad_x.data, grad_x_narrow.data, partial_w,
                               partial_b);
    launch_layer_norm_param_grads(l, a, partial_w, partial_b, static_cast<float*>(grad_weight.data),
                                  static_cast<float*>(grad_bias.data));
  }

  bool fused_batch_norm_supported(DType dtype) const override { return cuda::fused_batch_norm_supported(dtype); }

  void batch_norm_forward(const TensorView& out, const TensorView& mean, const TensorView& rstd,
                          const TensorView& x, const TensorView& weight, const TensorView& bias,
                          const TensorView& running_mean, const TensorView& running_var, bool training,
                          double momentum, double eps) override {
    const BatchNormArgs a = batch_norm_args(x, weight, bias, mean, rstd);
    check_same_dtype("batch_norm", "output", x, out);
    check<ShapeError>(out.numel() == x.numel(), "CUDA batch_norm: output {} does not match input {}", shape_of(out),
                      shape_of(x));
    check_contiguous("batch_norm", out);
    check_per_channel(a, {&running_mean, &running_var});
    check<ValueError>(!running_mean.data == !running_var.data,
                      "CUDA batch_norm: running_mean and running_var must be given together");
    const Launch l = current_launch();
    auto* rm = static_cast<float*>(running_mean.data);
    auto* rv = static_cast<float*>(running_var.data);
    if (training) {
      check<ShapeError>(a.n * a.s > 1, "CUDA batch_norm: training needs more than one value per channel, got {}",
                        shape_of(x));
      const LaunchScratch scratch(l, batch_norm_scratch_bytes(l, a));
      launch_batch_norm_statistics(l, a, rm, rv, momentum, eps, scratch.get());
    } else {
      check<ValueError>(rm != nullptr, "CUDA batch_norm: without training, the running statistics normalise");
      launch_batch_norm_running_statistics(l, a, rm, rv, eps);
    }
    launch_batch_norm_apply(l, a, out.data);
  }

  void batch_norm_backward(const TensorView& grad_x, const TensorView& grad_weight, const TensorView& grad_bias,
                           const TensorView& grad_out, const TensorView& x, const TensorView& weight,
                           const TensorView& mean, const TensorView& rstd, bool training) override {
    const BatchNormArgs a = batch_norm_args(x, weight, TensorView{}, mean, rstd);
    for (const TensorView* t : {&grad_x, &grad_out}) {
      if (!t->data) continue;
      check_same_dtype("batch_norm", "backward", x, *t);
      check<ShapeError>(t->numel() == x.numel(), "CUDA batch_norm backward: {} does not match input {}",
                        shape_of(*t), shape_of(x));
      check_contiguous("batch_norm backward", *t);
    }
    check_per_channel(a, {&grad_weight, &grad_bias});
    const Launch l = current_launch();
    const LaunchScratch scratch(l, batch_norm_scratch_bytes(l, a));
    launch_batch_norm_backward(l, a, grad_out.data, grad_x.data, static_cast<float*>(grad_weight.data),
                               static_cast<float*>(grad_bias.data), training, scratch.get());
  }

  bool fused_cross_entropy_supported(DType dtype) const override { return cuda::fused_cross_entropy_supported(dtype); }

  void cross_entropy_forward(const TensorView& loss, const TensorView& lse, const TensorView& valid,
                             const TensorView& logits, const TensorView& target, int64_t ignore_index) override {
    const CrossEntropyArgs a = cross_entropy_args(logits, target, lse, ignore_index);
    for (const TensorView* t : {&loss, &valid})
      check<ShapeError>(t->dtype == DType::f32 && t->numel() == a.rows && t->is_contiguous(),
                        "CUDA cross_entropy: loss and valid must be contiguous f32 [{}]", a.rows);
    launch_cross_entropy_forward(current_launch(), logits.dtype, a, static_cast<float*>(loss.data),
                                 static_cast<float*>(valid.data));
  }

  void cross_entropy_backward(const TensorView& grad, const TensorView& logits, const TensorView& target,
                              const TensorView& lse, const TensorView& row_scale) override {
    const CrossEntropyArgs a = cross_entropy_args(logits, target, lse, 0);
    check_same_dtype("cross_entropy", "backward", logits, grad);
    check<ShapeError>(grad.numel() == logits.numel() && grad.is_contiguous(),
                      "CUDA cross_entropy backward: gradient {} does not match logits {}", shape_of(grad),
                      shape_of(logits));
    check<ShapeError>(row_scale.dtype == DType::f32 && row_scale.numel() == a.rows && row_scale.is_contiguous(),
                      "CUDA cross_entropy backward: row scale must be contiguous f32 [{}]", a.rows);
    launch_cross_entropy_backward(current_launch(), logits.dtype, a, static_cast<const float*>(row_scale.data),
                                  grad.data);
  }

  void quantize_fp8(const Fp8QuantizeArgs& args) override {
    const Launch l = current_launch();
    const LaunchScratch scratch(l, quantize_fp8_scratch_bytes(args));
    launch_quantize_fp8(l, args, scratch.get());
  }
  void gemm_fp8(const Fp8GemmArgs& args) override { cuda::gemm_fp8(args); }
  void amax_into(const TensorView& amax, const TensorView& in) override {
    launch_amax_into(current_launch(), amax, in);
  }

  void scaled_copy_list(const std::vector<TensorView>& dsts, const std::vector<TensorView>& srcs,
                        double scale) override {
    check(dsts.size() == srcs.size(), "CUDA scaled_copy_list: {} destinations for {} sources", dsts.size(),
          srcs.size());
    if (dsts.empty()) return;
    std::vector<const void*> from;
    std::vector<void*> to;
    std::vector<int64_t> sizes;
    for (size_t i = 0; i < dsts.size(); ++i) {
      check_same_shape("scaled_copy_list", dsts[i], srcs[i]);
      check_contiguous("scaled_copy_list", dsts[i]);
      check_contiguous("scaled_copy_list", srcs[i]);
      check<DTypeError>(dsts[i].dtype == dsts[0].dtype && srcs[i].dtype == srcs[0].dtype,
                        "CUDA scaled_copy_list: pair {} is {} from {}, pair 0 {} from {}", i,
                        dtype_name(dsts[i].dtype), dtype_name(srcs[i].dtype), dtype_name(dsts[0].dtype),
                        dtype_name(srcs[0].dtype));
      from.push_back(srcs[i].data);
      to.push_back(dsts[i].data);
      sizes.push_back(dsts[i].numel());
    }
    const Launch l = current_launch();
    launch_scaled_copy_list(srcs[0].dtype, dsts[0].dtype, from.data(), to.data(), sizes.data(), sizes.size(),
                            static_cast<float>(scale), l.stream);
  }

  bool fused_attention_supported(DType dtype, int64_t head_dim) const override {
    return cuda::fused_attention_supported(dtype, head_dim);
  }

  void attention_forward(const TensorView& out, const TensorView& lse, const TensorView& q, const TensorView& k,
                         const TensorView& v, bool causal, double scale) override {
    const Launch l = current_launch();
    const AttentionArgs a = attention_args(out, lse, q, k, v, causal, scale);
    const std::string why_not_cudnn = cudnn_attention_forward(l, a);
    if (!why_not_cudnn.empty()) launch_attention_forward(l, a);
    note_attention_kernel(false, why_not_cudnn.empty() ? "cudnn" : "own (" + why_not_cudnn + ")");
  }

  void attention_backward(const TensorView& grad_q, const TensorView& grad_k, const TensorView& grad_v,
                          const TensorView& delta, const TensorView& q, const TensorView& k, const TensorView& v,
                          const TensorView& out, const TensorView& lse, const TensorView& grad_out, bool causal,
                          double scale) override {
    const AttentionArgs a = attention_args(out, lse, q, k, v, causal, scale);
    for (const TensorView* t : {&grad_q, &grad_k, &grad_v, &grad_out}) {
      check_same_dtype("attention", "backward", q, *t);
      check_same_shape("attention backward", q, *t);
    }
    check<DTypeError>(delta.dtype == DType::f32, "CUDA attention backward: delta must be f32, got {}",
                      dtype_name(delta.dtype));
    check<ShapeError>(delta.numel() == a.batch * a.heads * a.len,
                      "CUDA attention backward: delta {} does not fit q {}", shape_of(delta), shape_of(q));
    check_contiguous("attention", delta);
    AttentionGrads g;
    g.grad_out = grad_out.data;
    g.grad_out_layout = attention_layout(grad_out, "grad_out");
    g.grad_q = grad_q.data;
    g.grad_q_layout = attention_layout(grad_q, "grad_q");
    g.grad_k = grad_k.data;
    g.grad_k_layout = attention_layout(grad_k, "grad_k");
    g.grad_v = grad_v.data;
    g.grad_v_layout = attention_layout(grad_v, "grad_v");
    g.delta = static_cast<float*>(delta.data);
    const Launch l = current_launch();
    const std::string why_not_cudnn = cudnn_attention_backward(l, a, g);
    if (!why_not_cudnn.empty()) launch_attention_backward(l, a, g);
    note_attention_kernel(true, why_not_cudnn.empty() ? "cudnn" : "own (" + why_not_cudnn + ")");
  }

 private:
  static void check_same_shape(const char* op, const TensorView& a, const TensorView& b) {
    check<ShapeError>(std::equal(a.shape, a.shape + a.ndim, b.shape, b.shape + b.ndim),
                      "CUDA {}: shapes {} and {} differ", op, shape_of(a), shape_of(b));
  }

  // y_dtype: the forward's output and the backward's incoming gradient.
  static LayerNormArgs layer_norm_args(const TensorView& x, DType y_dtype, const TensorView& weight,
                                       const TensorView& bias, const TensorView& mean, const TensorView& rstd,
                                       double eps) {
    check<ShapeError>(x.ndim >= 1, "CUDA layer_norm: input must have a dimension");
    const int64_t d = x.shape[x.ndim - 1];
    check<DTypeError>(cuda::fused_layer_norm_supported(x.dtype, y_dtype, d),
                      "CUDA layer_norm: fused kernels take f32/f16/bf16 rows of at most {} elements, written in "
                      "their own dtype or, from f32, in f16/bf16; got {} {} to {}",
                      kMaxFusedLayerNorm, dtype_name(x.dtype), shape_of(x), dtype_name(y_dtype));
    check_contiguous("layer_norm", x);
    for (const TensorView* p : {&weight, &bias}) {
      if (!p->data) continue;
      check_same_dtype("layer_norm", "parameter", x, *p);
      check<ShapeError>(p->numel() == d && p->is_contiguous(), "CUDA layer_norm: parameter {} does not fit input {}",
                        shape_of(*p), shape_of(x));
    }
    LayerNormArgs a;
    a.dtype = x.dtype;
    a.y_dtype = y_dtype;
    a.d = static_cast<int>(d);
    a.rows = d ? x.numel() / d : 0;
    for (const TensorView* t : {&mean, &rstd})
      check<ShapeError>(t->dtype == DType::f32 && t->numel() == a.rows && t->is_contiguous(),
                        "CUDA layer_norm: mean and rstd must be contiguous f32 with one value per row");
    a.x = x.data;
    a.weight = weight.data;
    a.bias = bias.data;
    a.mean = static_cast<float*>(mean.data);
    a.rstd = static_cast<float*>(rstd.data);
    a.eps = static_cast<float>(eps);
    return a;
  }

  // x viewed as [n, c, s]; weight, bias (either may have null data), mean
  // and rstd f32 [c].
  static BatchNormArgs batch_norm_args(const TensorView& x, const TensorView& weight, const TensorView& bias,
                                       const TensorView& mean, const TensorView& rstd) {
    check<DTypeError>(cuda::fused_batch_norm_supported(x.dtype), "CUDA batch_norm: input must be f32, f16 or bf16, got {}",
                      dtype_name(x.dtype));
    check<ShapeError>(x.ndim >= 2, "CUDA batch_norm: input {} must be [N, C, ...]", shape_of(x));
    check_contiguous("batch_norm", x);
    BatchNormArgs a;
    a.dtype = x.dtype;
    a.n = x.shape[0];
    a.c = x.shape[1];
    a.s = 1;
    for (int d = 2; d < x.ndim; ++d) a.s *= x.shape[d];
    check_per_channel(a, {&weight, &bias});
    check<ShapeError>(mean.data && rstd.data, "CUDA batch_norm: mean and rstd are needed");
    check_per_channel(a, {&mean, &rstd});
    a.x = x.data;
    a.weight = static_cast<const float*>(weight.data);
    a.bias = static_cast<const float*>(bias.data);
    a.mean = static_cast<float*>(mean.data);
    a.rstd = static_cast<float*>(rstd.data);
    return a;
  }

  // Each of `ts` with data is contiguous f32 [a.c].
  static void check_per_channel(const BatchNormArgs& a, std::initializer_list<const TensorView*> ts) {
    for (const TensorView* t : ts)
      if (t->data && !(t->dtype == DType::f32 && t->numel() == a.c && t->is_contiguous()))
        throw ShapeError(fmt::format("CUDA batch_norm: per-channel tensors must be contiguous f32 [{}], got {} {}", a.c,
                                     dtype_name(t->dtype), shape_of(*t)));
  }

  static CrossEntropyArgs cross_entropy_args(const TensorView& logits, const TensorView& target,
                                             const TensorView& lse, int64_t ignore_index) {
    check<DTypeError>(cuda::fused_cross_entropy_supported(logits.dtype),
                      "CUDA cross_entropy: logits must be f32, f16 or bf16, got {}", dtype_name(logits.dtype));
    check<DTypeError>(target.dtype == DType::i64, "CUDA cross_entropy: targets must be i64, got {}",
                      dtype_name(target.dtype));
    check<ShapeError>(logits.ndim == 2 && target.numel() == logits.shape[0] && lse.numel() == logits.shape[0] &&
                          lse.dtype == DType::f32,
                      "CUDA cross_entropy: logits {}, targets {} and lse {} do not fit together", shape_of(logits),
                      shape_of(target), shape_of(lse));
    for (const TensorView* t : {&logits, &target, &lse}) check_contiguous("cross_entropy", *t);
    CrossEntropyArgs a;
    a.rows = logits.shape[0];
    a.classes = logits.shape[1];
    a.logits = logits.data;
    a.target = static_cast<const int64_t*>(target.data);
    a.lse = static_cast<float*>(lse.data);
    a.ignore_index = ignore_index;
    return a;
  }

  // The layout of a [B, H, T, D] attention operand whose rows are packed
  // and 16-byte aligned, as the kernels load them.
  static AttentionLayout attention_layout(const TensorView& t, const char* name) {
    const int64_t align = 16 / static_cast<int64_t>(dtype_size(t.dtype));
    bool ok = t.strides[3] == 1 && reinterpret_cast<uintptr_t>(t.data) % 16 == 0;
    for (int d = 0; d < 3; ++d) ok = ok && (t.shape[d] == 1 || t.strides[d] % align == 0);
    check<ShapeError>(ok, "CUDA attention: {} {} with strides [{}, {}, {}, {}] needs packed rows starting on 16-byte "
                      "boundaries", name, shape_of(t), t.strides[0], t.strides[1], t.strides[2], t.strides[3]);
    return {t.strides[0], t.strides[1], t.strides[2]};
  }

  static AttentionArgs attention_args(const TensorView& out, const TensorView& lse, const TensorView& q,
                                      const TensorView& k, const TensorView& v, bool causal, double scale) {
    check<ShapeError>(q.ndim == 4, "CUDA attention: q must be [B, H, T, D], got {}", shape_of(q));
    for (const TensorView* t : {&k, &v, &out}) {
      check_same_dtype("attention", "forward", q, *t);
      check_same_shape("attention", q, *t);
    }
    check<DTypeError>(cuda::fused_attention_supported(q.dtype, q.shape[3]),
                      "CUDA attention: fused kernels take f16/bf16 with head size 32, 64 or 128, got {} {}",
                      dtype_name(q.dtype), shape_of(q));
    check<ShapeError>(q.shape[2] <= cuda::kAttentionMaxLength,
                      "CUDA attention: sequence length {} is above the fused kernels' limit of {}", q.shape[2],
                      cuda::kAttentionMaxLength);
    check<DTypeError>(lse.dtype == DType::f32 && lse.numel() == q.shape[0] * q.shape[1] * q.shape[2],
                      "CUDA attention: lse must be f32 [B, H, T], got {} {}", dtype_name(lse.dtype), shape_of(lse));
    check_contiguous("attention", lse);
    AttentionArgs a;
    a.dtype = q.dtype;
    a.batch = q.shape[0];
    a.heads = q.shape[1];
    a.len = static_cast<int>(q.shape[2]);
    a.head_dim = q.shape[3];
    a.q = q.data;
    a.k = k.data;
    a.v = v.data;
    a.out = out.data;
    a.q_layout = attention_layout(q, "q");
    a.k_layout = attention_layout(k, "k");
    a.v_layout = attention_layout(v, "v");
    a.out_layout = attention_layout(out, "out");
    a.lse = static_cast<float*>(lse.data);
    a.scale = scale;
    a.causal = causal;
    return a;
  }

  // rows [n, d], table [V, d], idx i64 [n], all contiguous.
  static void check_rows(const char* op, const TensorView& rows, const TensorView& table, const TensorView& idx) {
    check<DTypeError>(idx.dtype == DType::i64, "CUDA {}: indices must be i64, got {}", op, dtype_name(idx.dtype));
    check<ShapeError>(rows.ndim == 2 && table.ndim == 2 && idx.ndim == 1 && rows.shape[0] == idx.shape[0] &&
                          rows.shape[1] == table.shape[1],
                      "CUDA {}: rows {}, table {} and indices {} do not fit together", op, shape_of(rows),
                      shape_of(table), shape_of(idx));
    check_contiguous(op, rows);
    check_contiguous(op, table);
    check_contiguous(op, idx);
  }

  static void check_conv(const char* op, std::initializer_list<const TensorView*> views) {
    for (const TensorView* v : views) {
      check_float("conv2d", op, v->dtype);
      check_same_dtype("conv2d", op, **views.begin(), *v);
      check<ShapeError>(v->ndim == 4, "CUDA {}: operands must be 4-d, got {}", op, shape_of(*v));
      check_contiguous(op, *v);
    }
  }

  static void check_pool(const char* op, const TensorView& out, const TensorView& indices, const TensorView& x) {
    check_float("pool", op, x.dtype);
    check_same_dtype("pool", op, x, out);
    check<DTypeError>(indices.dtype == DType::i64, "CUDA {}: indices must be i64, got {}", op,
                      dtype_name(indices.dtype));
    check<ShapeError>(x.ndim == 4 && out.ndim == 4 && indices.ndim == 4, "CUDA {}: operands must be 4-d", op);
    for (const TensorView* v : {&out, &indices, &x}) check_contiguous(op, *v);
  }

  static void random(const TensorView& out, uint64_t seed, uint64_t offset, bool normal, double a, double b,
                     const char* name) {
    check<DTypeError>(is_float(out.dtype), "CUDA {}: dtype {} is not supported (f32, f16, bf16, f64)", name,
                      dtype_name(out.dtype));
    check_contiguous(name, out);
    const int64_t n = out.numel();
    if (n == 0) return;
    launch_random(current_launch(), out.data, out.dtype, n, seed, offset, normal, a, b);
  }
};

}  // namespace
}  // namespace cuda

Backend& cuda_backend() {
  static cuda::CudaBackend backend;
  return backend;
}

}  // namespace mpt
