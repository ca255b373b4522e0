// Raw ops for joining, gathering, convolution and pooling: checks and
// allocation here, arithmetic in the backends.
#include "tensor/dispatch.h"
#include "tensor/index_check.h"
#include "tensor/operand_check.h"
#include "tensor/ops.h"

namespace mpt::prim {
namespace {

Tensor as_i64(const Tensor& idx, const char* op) {
  check<DTypeError>(idx.dtype() == DType::i64 || idx.dtype() == DType::i32, "{}: indices must be i64 or i32, got {}",
                    op, describe(idx));
  return contiguous(to(idx, DType::i64));
}

int64_t conv_out_size(int64_t in, int64_t k, int64_t stride, int64_t pad, int64_t dilation) {
  return (in + 2 * pad - dilation * (k - 1) - 1) / stride + 1;
}

Shape conv_out_shape(const Shape& x, const Shape& w, const Conv2dParams& p) {
  return {x[0], w[0], conv_out_size(x[2], w[2], p.stride_h, p.pad_h, p.dilation_h),
          conv_out_size(x[3], w[3], p.stride_w, p.pad_w, p.dilation_w)};
}

void check_conv(const Shape& x, const Shape& w, const Conv2dParams& p) {
  check<ShapeError>(x.size() == 4 && w.size() == 4 && x[1] == w[1] && w[2] > 0 && w[3] > 0,
                    "conv2d: expects input [N, C, H, W] and weight [O, C, kh, kw] with equal C and a kernel of at "
                    "least 1x1, got {} and {}",
                    shape_str(x), shape_str(w));
  check(p.stride_h > 0 && p.stride_w > 0 && p.dilation_h > 0 && p.dilation_w > 0 && p.pad_h >= 0 && p.pad_w >= 0,
        "conv2d: stride and dilation must be positive and padding non-negative, got stride ({}, {}) dilation ({}, {}) "
        "pad ({}, {})",
        p.stride_h, p.stride_w, p.dilation_h, p.dilation_w, p.pad_h, p.pad_w);
  const Shape o = conv_out_shape(x, w, p);
  check<ShapeError>(o[2] > 0 && o[3] > 0, "conv2d: kernel {} does not fit input {} with this padding", shape_str(w),
                    shape_str(x));
}

// The output gradient must have the forward output's shape.
void check_conv_grad(const char* op, const Tensor& grad_out, const Shape& x, const Shape& w, const Conv2dParams& p) {
  check<ShapeError>(grad_out.shape() == conv_out_shape(x, w, p),
                    "{}: gradient {} does not match the output {} of input {} and weight {}", op, describe(grad_out),
                    shape_str(conv_out_shape(x, w, p)), shape_str(x), shape_str(w));
}

// A convolution's result where some operand holds no element (a batch, or
// input or output channels, of 0): the result's own elements, if any, are
// sums over nothing. cuDNN refuses such shapes, so no backend sees them.
// Returns whether `result` is done.
bool conv_of_nothing(const Tensor& result, const Tensor& a, const Tensor& b) {
  if (result.numel() > 0 && a.numel() > 0 && b.numel() > 0) return false;
  if (result.numel() > 0) fill_(result, 0.0);
  return true;
}

// [N, C, HO, WO] after checking the parameters and that the window fits.
Shape pool_out_shape(const char* op, const Shape& x, const Pool2dParams& p) {
  check<ShapeError>(x.size() == 4 && x[2] > 0 && x[3] > 0, "{}: expects [N, C, H, W] with H and W above 0, got {}", op,
                    shape_str(x));
  check(p.kernel_h > 0 && p.kernel_w > 0 && p.stride_h > 0 && p.stride_w > 0 && p.pad_h >= 0 && p.pad_w >= 0 &&
            2 * p.pad_h <= p.kernel_h && 2 * p.pad_w <= p.kernel_w,
        "{}: kernel and stride must be positive, padding at most half the kernel, got kernel {}x{} stride "
        "({}, {}) pad ({}, {})",
        op, p.kernel_h, p.kernel_w, p.stride_h, p.stride_w, p.pad_h, p.pad_w);
  const int64_t ho = (x[2] + 2 * p.pad_h - p.kernel_h) / p.stride_h + 1;
  const int64_t wo = (x[3] + 2 * p.pad_w - p.kernel_w) / p.stride_w + 1;
  check<ShapeError>(ho > 0 && wo > 0, "{}: kernel {}x{} does not fit input {}", op, p.kernel_h, p.kernel_w,
                    shape_str(x));
  return {x[0], x[1], ho, wo};
}

}  // namespace

Tensor cat(const std::vector<Tensor>& xs, int64_t dim) {
  check<ShapeError>(!xs.empty(), "cat: no tensors given");
  const Tensor& first = xs[0];
  check_defined("cat", first);
  const int d = normalize_existing_dim(dim, first.dim(), "cat");
  Shape shape = first.shape();
  shape[d] = 0;
  for (const Tensor& x : xs) {
    check_same_device_and_dtype("cat", first, x);
    Shape s = x.shape();
    check<ShapeError>(s.size() == shape.size(), "cat: {} and {} differ in rank", describe(first), describe(x));
    shape[d] += s[d];
    s[d] = 0;
    Shape expect = shape;
    expect[d] = 0;
    check<ShapeError>(s == expect, "cat: {} does not match {} outside dimension {}", describe(x), describe(first), d);
  }
  Tensor out = Tensor::empty(shape, first.dtype(), first.device());
  int64_t start = 0;
  for (const Tensor& x : xs) {
    copy_(slice(out, d, start, start + x.shape()[d]), x);
    start += x.shape()[d];
  }
  return out;
}

Tensor index_select_rows(const Tensor& table, const Tensor& indices) {
  check<ShapeError>(table.dim() == 2, "index_select_rows: table must be [V, D], got {}", describe(table));
  check_same_device("index_select_rows", table, indices);
  // CPU indices are checked here (the kernel copies rows blindly); CUDA
  // kernels keep a bad index inside the table and callers enqueue the
  // deferred check (embedding), which would cost a launch here.
  if (!indices.device().is_cuda()) check_index_range("index_select_rows", indices, table.shape()[0]);
  const Tensor idx = as_i64(indices, "index_select_rows");
  Shape shape = indices.shape();
  shape.push_back(table.shape()[1]);
  Tensor out = Tensor::empty(shape, table.dtype(), table.device());
  if (out.numel() == 0) return out;
  const Tensor t = contiguous(table);
  on_device(table.device(), [&](Backend& b) {
    b.index_select_rows(reshape(out, {-1, table.shape()[1]}).view(), t.view(), reshape(idx, {-1}).view());
  });
  return out;
}

void index_add_rows_(const Tensor& table, const Tensor& indices, const Tensor& src) {
  check<ShapeError>(table.dim() == 2 && table.is_contiguous(), "index_add_rows_: table must be a contiguous [V, D], got {}",
                    describe(table));
  check_same_device_and_dtype("index_add_rows_", table, src);
  check_no_float8("index_add_rows_", table);
  check_same_device("index_add_rows_", table, indices);
  Shape expect = indices.shape();
  expect.push_back(table.shape()[1]);
  check<ShapeError>(src.shape() == expect, "index_add_rows_: source {} does not match indices {} and table {}",
                    describe(src), describe(indices), describe(table));
  table.bump_version();
  if (src.numel() == 0) return;
  if (!indices.device().is_cuda()) check_index_range("index_add_rows_", indices, table.shape()[0]);  // as above
  const Tensor idx = as_i64(indices, "index_add_rows_");
  const Tensor s = contiguous(src);
  on_device(table.device(), [&](Backend& b) {
    b.index_add_rows(table.view(), reshape(idx, {-1}).view(), reshape(s, {-1, table.shape()[1]}).view());
  });
}

Tensor conv2d(const Tensor& x, const Tensor& weight, const Conv2dParams& p) {
  check_same_device_and_dtype("conv2d", x, weight);
  check_no_float8("conv2d", x);
  check_conv(x.shape(), weight.shape(), p);
  Tensor out = Tensor::empty(conv_out_shape(x.shape(), weight.shape(), p), x.dtype(), x.device());
  if (conv_of_nothing(out, x, weight)) return out;
  const Tensor cx = contiguous(x), cw = contiguous(weight);
  on_device(x.device(), [&](Backend& b) { b.conv2d_forward(out.view(), cx.view(), cw.view(), p); });
  return out;
}

Tensor conv2d_backward_data(const Tensor& grad_out, const Tensor& weight, const Shape& x_shape, const Conv2dParams& p) {
  check_same_device_and_dtype("conv2d backward", grad_out, weight);
  check_no_float8("conv2d backward", weight);
  check_conv(x_shape, weight.shape(), p);
  check_conv_grad("conv2d backward", grad_out, x_shape, weight.shape(), p);
  Tensor gx = Tensor::empty(x_shape, weight.dtype(), weight.device());
  if (conv_of_nothing(gx, grad_out, weight)) return gx;
  const Tensor g = contiguous(grad_out), w = contiguous(weight);
  on_device(gx.device(), [&](Backend& b) { b.conv2d_backward_data(gx.view(), g.view(), w.view(), p); });
  return gx;
}

Tensor conv2d_backward_weight(const Tensor& x, const Tensor& grad_out, const Shape& w_shape, const Conv2dParams& p) {
  check_same_device_and_dtype("conv2d backward", x, grad_out);
  check_no_float8("conv2d backward", x);
  check_conv(x.shape(), w_shape, p);
  check_conv_grad("conv2d backward", grad_out, x.shape(), w_shape, p);
  Tensor gw = Tensor::empty(w_shape, x.dtype(), x.device());
  if (conv_of_nothing(gw, x, grad_out)) return gw;
  const Tensor cx = contiguous(x), g = contiguous(grad_out);
  on_device(gw.device(), [&](Backend& b) { b.conv2d_backward_weight(gw.view(), cx.view(), g.view(), p); });
  return gw;
}

std::pair<Tensor, Tensor> max_pool2d(const Tensor& x, const Pool2dParams& p) {
  check<ShapeError>(x.dim() == 4, "max_pool2d: expects [N, C, H, W], got {}", describe(x));
  check_no_float8("max_pool2d", x);
  const Shape shape = pool_out_shape("max_pool2d", x.shape(), p);
  Tensor out = Tensor::empty(shape, x.dtype(), x.device());
  Tensor indices = Tensor::empty(shape, DType::i64, x.device());
  const Tensor cx = contiguous(x);
  if (out.numel() > 0)
    on_device(x.device(), [&](Backend& b) { b.max_pool2d_forward(out.view(), indices.view(), cx.view(), p); });
  return {out, indices};
}

Tensor max_pool2d_backward(const Tensor& grad_out, const Tensor& indices, const Shape& x_shape, const Pool2dParams& p) {
  const Shape out_shape = pool_out_shape("max_pool2d backward", x_shape, p);
  check<ShapeError>(grad_out.shape() == out_shape && indices.shape() == out_shape,
                    "max_pool2d backward: gradient {} and indices {} must match the output {} of input {}",
                    describe(grad_out), describe(indices), shape_str(out_shape), shape_str(x_shape));
  check_same_device("max_pool2d backward", grad_out, indices);
  check_no_float8("max_pool2d backward", grad_out);
  check<DTypeError>(indices.dtype() == DType::i64, "max_pool2d backward: indices must be i64, got {}",
                    describe(indices));
  Tensor gx = Tensor::empty(x_shape, grad_out.dtype(), grad_out.device());
  const Tensor g = contiguous(grad_out), idx = contiguous(indices);
  on_device(gx.device(), [&](Backend& b) { b.max_pool2d_backward(gx.view(), g.view(), idx.view(), p); });
  return gx;
}

bool fused_layer_norm_available(const Tensor& x, const Tensor& weight, const Tensor& bias, DType out_dtype) {
  if (!x.defined() || x.dim() < 1) return false;
  for (const Tensor* p : {&weight, &bias})
    if (p->defined() && (p->dtype() != x.dtype() || p->device() != x.device() || p->shape() != Shape{x.shape().back()}))
      return false;
  bool supported = false;
  on_device(x.device(),
            [&](Backend& b) { supported = b.fused_layer_norm_supported(x.dtype(), out_dtype, x.shape().back()); });
  return supported;
}

std::vector<Tensor> layer_norm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                                       DType out_dtype) {
  check(fused_layer_norm_available(x, weight, bias, out_dtype), "layer_norm_forward: no fused kernel for {} to {}",
        describe(x), dtype_name(out_dtype));
  const Tensor cx = contiguous(x);
  const Tensor cw = weight.defined() ? contiguous(weight) : Tensor();
  const Tensor cb = bias.defined() ? contiguous(bias) : Tensor();
  Shape stats_shape = x.shape();
  stats_shape.back() = 1;
  Tensor out = Tensor::empty(x.shape(), out_dtype, x.device());
  Tensor mean = Tensor::empty(stats_shape, DType::f32, x.device());
  Tensor rstd = Tensor::empty(stats_shape, DType::f32, x.device());
  if (x.numel() > 0)
    on_device(x.device(), [&](Backend& b) {
      b.layer_norm_forward(out.view(), mean.view(), rstd.view(), cx.view(), view_or_none(cw), view_or_none(cb), eps);
    });
  return {out, mean, rstd};
}

std::vector<Tensor> layer_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                                        const Tensor& mean, const Tensor& rstd, bool want_weight, bool want_bias,
                                        const Tensor& grad_x_more) {
  // The gradient keeps its dtype where the kernel reads it (the forward's
  // 16-bit output from f32 x), else it takes x's.
  const bool reads_grad_dtype = fused_layer_norm_available(x, weight, Tensor(), grad_out.dtype());
  const DType g_dtype = reads_grad_dtype ? grad_out.dtype() : x.dtype();
  check(reads_grad_dtype || fused_layer_norm_available(x, weight, Tensor(), g_dtype),
        "layer_norm_backward: no fused kernel for {}", describe(x));
  check<ShapeError>(grad_out.shape() == x.shape(), "layer_norm backward: gradient {} does not match input {}",
                    describe(grad_out), describe(x));
  const int64_t d = x.shape().back();
  const Tensor g = contiguous(to(grad_out, g_dtype)), cx = contiguous(x);
  const Tensor cw = weight.defined() ? contiguous(weight) : Tensor();
  Tensor more;
  if (grad_x_more.defined()) {
    check<ShapeError>(grad_x_more.shape() == x.shape(), "layer_norm backward: gradient {} does not match input {}",
                      describe(grad_x_more), describe(x));
    more = contiguous(to(grad_x_more, x.dtype()));
  }
  Tensor gx = Tensor::empty(x.shape(), x.dtype(), x.device());
  Tensor gw = want_weight ? Tensor::empty({d}, DType::f32, x.device()) : Tensor();
  Tensor gb = want_bias ? Tensor::empty({d}, DType::f32, x.device()) : Tensor();
  if (x.numel() == 0) {
    for (Tensor* t : {&gw, &gb})
      if (t->defined()) fill_(*t, 0.0);
    return {gx, gw, gb};
  }
  // An f32 x normalised into a 16-bit output is a residual stream in f32
  // under autocast: the add that made x hands its 16-bit branch this
  // gradient cast to 16 bits. The kernel writes that copy as it writes gx,
  // and leaves it with gx's memory for the cast to take (one pass over the
  // gradient less for each residual add).
  const bool narrow = x.dtype() == DType::f32 && g_dtype != DType::f32;
  Tensor gx_narrow = narrow ? Tensor::empty(x.shape(), g_dtype, x.device()) : Tensor();
  on_device(x.device(), [&](Backend& b) {
    b.layer_norm_backward(gx.view(), view_or_none(gx_narrow), view_or_none(gw), view_or_none(gb), g.view(),
                          view_or_none(more), cx.view(), view_or_none(cw), mean.view(), rstd.view());
  });
  if (narrow)
    gx.storage()->set_narrow_copy({gx_narrow.storage(), g_dtype, gx.offset(), gx.numel(), gx.version(),
                                   gx_narrow.version()});
  return {gx, gw, gb};
}

bool fused_batch_norm_available(const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                                const Tensor& weight, const Tensor& bias) {
  if (!x.defined() || x.dim() < 2 || x.numel() == 0 || !x.device().is_cuda()) return false;
  const Shape channels{x.size(1)};
  for (const Tensor* p : {&running_mean, &running_var, &weight, &bias})
    if (p->defined() && (p->dtype() != DType::f32 || p->device() != x.device() || p->shape() != channels ||
                         !p->is_contiguous()))
      return false;
  bool supported = false;
  on_device(x.device(), [&](Backend& b) { supported = b.fused_batch_norm_supported(x.dtype()); });
  return supported;
}

std::vector<Tensor> batch_norm_forward(const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                                       const Tensor& weight, const Tensor& bias, bool training, double momentum,
                                       double eps) {
  if (!fused_batch_norm_available(x, running_mean, running_var, weight, bias))
    throw Error(fmt::format("batch_norm_forward: no fused kernel for {}", describe(x)));
  const Tensor cx = contiguous(x);
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  Tensor mean = Tensor::empty({x.size(1)}, DType::f32, x.device());
  Tensor rstd = Tensor::empty({x.size(1)}, DType::f32, x.device());
  on_device(x.device(), [&](Backend& b) {
    b.batch_norm_forward(out.view(), mean.view(), rstd.view(), cx.view(), view_or_none(weight), view_or_none(bias),
                         view_or_none(running_mean), view_or_none(running_var), training, momentum, eps);
  });
  if (training && running_mean.defined()) {  // written in place
    running_mean.bump_version();
    running_var.bump_version();
  }
  return {out, mean, rstd};
}

std::vector<Tensor> batch_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                                        const Tensor& mean, const Tensor& rstd, bool training, bool want_x,
                                        bool want_weight, bool want_bias) {
  if (!fused_batch_norm_available(x, Tensor(), Tensor(), weight, Tensor()))
    throw Error(fmt::format("batch_norm_backward: no fused kernel for {}", describe(x)));
  if (grad_out.shape() != x.shape())
    throw ShapeError(fmt::format("batch_norm backward: gradient {} does not match input {}", describe(grad_out),
                                 describe(x)));
  const Tensor g = contiguous(to(grad_out, x.dtype())), cx = contiguous(x);
  const int64_t c = x.size(1);
  Tensor gx = want_x ? Tensor::empty(x.shape(), x.dtype(), x.device()) : Tensor();
  Tensor gw = want_weight ? Tensor::empty({c}, DType::f32, x.device()) : Tensor();
  Tensor gb = want_bias ? Tensor::empty({c}, DType::f32, x.device()) : Tensor();
  on_device(x.device(), [&](Backend& b) {
    b.batch_norm_backward(view_or_none(gx), view_or_none(gw), view_or_none(gb), g.view(), cx.view(),
                          view_or_none(weight), mean.view(), rstd.view(), training);
  });
  return {gx, gw, gb};
}

bool fused_cross_entropy_available(const Tensor& logits) {
  if (!logits.defined() || logits.dim() != 2) return false;
  bool supported = false;
  on_device(logits.device(), [&](Backend& b) { supported = b.fused_cross_entropy_supported(logits.dtype()); });
  return supported;
}

std::vector<Tensor> cross_entropy_forward(const Tensor& logits, const Tensor& target, int64_t ignore_index) {
  check(fused_cross_entropy_available(logits), "cross_entropy_forward: no fused kernel for {}", describe(logits));
  check_same_device("cross_entropy_forward", logits, target);
  check<ShapeError>(target.shape() == Shape{logits.shape()[0]},
                    "cross_entropy_forward: target {} does not match logits {}", describe(target), describe(logits));
  const Tensor cl = contiguous(logits), t = contiguous(to(target, DType::i64));
  const int64_t n = logits.shape()[0];
  Tensor loss = Tensor::empty({n}, DType::f32, logits.device());
  Tensor lse = Tensor::empty({n}, DType::f32, logits.device());
  Tensor valid = Tensor::empty({n}, DType::f32, logits.device());
  if (n > 0)
    on_device(logits.device(), [&](Backend& b) {
      b.cross_entropy_forward(loss.view(), lse.view(), valid.view(), cl.view(), t.view(), ignore_index);
    });
  return {loss, lse, valid};
}

Tensor cross_entropy_backward(const Tensor& logits, const Tensor& target, const Tensor& lse, const Tensor& row_scale) {
  const Tensor cl = contiguous(logits), t = contiguous(to(target, DType::i64));
  const Tensor rs = contiguous(to(row_scale, DType::f32));
  Tensor grad = Tensor::empty(logits.shape(), logits.dtype(), logits.device());
  if (grad.numel() > 0)
    on_device(logits.device(), [&](Backend& b) {
      b.cross_entropy_backward(grad.view(), cl.view(), t.view(), lse.view(), reshape(rs, {-1}).view());
    });
  return grad;
}

bool fused_attention_available(const Tensor& q, const Tensor& k, const Tensor& v) {
  if (q.dim() != 4 || k.shape() != q.shape() || v.shape() != q.shape() || k.dtype() != q.dtype() ||
      v.dtype() != q.dtype() || k.device() != q.device() || v.device() != q.device())
    return false;
  bool supported = false;
  on_device(q.device(), [&](Backend& b) { supported = b.fused_attention_supported(q.dtype(), q.shape()[3]); });
  return supported;
}

namespace {

// An attention operand as the kernels read it: each row of D elements
// contiguous and starting on a 16-byte boundary (q, k, v cut from one fused
// projection qualify as they are); anything else is copied first.
Tensor attention_operand(const Tensor& t) {
  const int64_t align = 16 / static_cast<int64_t>(dtype_size(t.dtype()));
  bool packed_rows = t.strides()[3] == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int d = 0; d < 3; ++d) packed_rows = packed_rows && (t.shape()[d] == 1 || t.strides()[d] % align == 0);
  return packed_rows ? t : contiguous(t);
}

// A new [B, H, T, D] tensor laid out as [B, T, H, D]: the layout the heads
// are joined back in, so that joining them needs no copy.
Tensor heads_interleaved(const Shape& bhtd, DType dtype, const Device& device) {
  const Shape bthd{bhtd[0], bhtd[2], bhtd[1], bhtd[3]};
  return transpose(Tensor::empty(bthd, dtype, device), 1, 2);
}

// q, k and v as a fused projection's output [B, T, 3 * H * D] splits them:
// one block holds q | k | v for each (b, t), each [B, H, T, D] view reading
// its third in place.
bool split_from_one_block(const Tensor& q, const Tensor& k, const Tensor& v) {
  const Shape& s = q.shape();
  const int64_t third = s[1] * s[3];  // H * D
  const Shape strides{s[2] * 3 * third, s[3], 3 * third, 1};
  for (const Tensor* t : {&k, &v})
    if (t->storage() != q.storage() || t->dtype() != q.dtype() || t->shape() != s || t->strides() != q.strides())
      return false;
  for (size_t d = 0; d < 4; ++d)
    if (s[d] > 1 && q.strides()[d] != strides[d]) return false;
  return k.offset() == q.offset() + third && v.offset() == q.offset() + 2 * third;
}

// A third of a new [B, T, 3 * H * D] block viewed as [B, H, T, D], as the
// fused projection's output is split for attention.
Tensor third_of_block(const Tensor& block, int64_t i, const Shape& bhtd) {
  const int64_t third = bhtd[1] * bhtd[3];
  const Tensor part = slice(block, 2, i * third, (i + 1) * third);
  return transpose(reshape(part, {bhtd[0], bhtd[2], bhtd[1], bhtd[3]}), 1, 2);
}

}  // namespace

std::pair<Tensor, Tensor> attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                            double scale) {
  check(fused_attention_available(q, k, v), "attention_forward: no fused kernel for q {}, k {}, v {}", describe(q),
        describe(k), describe(v));
  const Tensor cq = attention_operand(q), ck = attention_operand(k), cv = attention_operand(v);
  Tensor out = heads_interleaved(q.shape(), q.dtype(), q.device());
  Tensor lse = Tensor::empty({q.shape()[0], q.shape()[1], q.shape()[2]}, DType::f32, q.device());
  on_device(q.device(), [&](Backend& b) {
    b.attention_forward(out.view(), lse.view(), cq.view(), ck.view(), cv.view(), causal, scale);
  });
  return {out, lse};
}

std::vector<Tensor> attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                       const Tensor& lse, const Tensor& grad_out, bool causal, double scale) {
  check(fused_attention_available(q, k, v), "attention_backward: no fused kernel for q {}, k {}, v {}", describe(q),
        describe(k), describe(v));
  check<ShapeError>(grad_out.shape() == q.shape(), "attention_backward: gradient {} does not match q {}",
                    describe(grad_out), describe(q));
  const Tensor cq = attention_operand(q), ck = attention_operand(k), cv = attention_operand(v);
  const Tensor co = attention_operand(out), g = attention_operand(to(grad_out, q.dtype()));
  // Where q, k and v were split from one block, their gradients fill one
  // block laid out the same way, which the split's backward then takes
  // whole (no copies joining them).
  const Shape& bhtd = q.shape();
  Tensor grad_q, grad_k, grad_v;
  if (split_from_one_block(q, k, v)) {
    const Tensor block = Tensor::empty({bhtd[0], bhtd[2], 3 * bhtd[1] * bhtd[3]}, q.dtype(), q.device());
    grad_q = third_of_block(block, 0, bhtd);
    grad_k = third_of_block(block, 1, bhtd);
    grad_v = third_of_block(block, 2, bhtd);
  } else {
    grad_q = heads_interleaved(bhtd, q.dtype(), q.device());
    grad_k = heads_interleaved(bhtd, q.dtype(), q.device());
    grad_v = heads_interleaved(bhtd, q.dtype(), q.device());
  }
  Tensor delta = Tensor::empty(lse.shape(), DType::f32, q.device());
  on_device(q.device(), [&](Backend& b) {
    b.attention_backward(grad_q.view(), grad_k.view(), grad_v.view(), delta.view(), cq.view(), ck.view(),
                         cv.view(), co.view(), lse.view(), g.view(), causal, scale);
  });
  return {grad_q, grad_k, grad_v};
}

}  // namespace mpt::prim
