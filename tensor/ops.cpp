#include "tensor/ops.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "tensor/dispatch.h"
#include "tensor/device_memory.h"
#include "tensor/operand_check.h"

namespace mpt {
namespace {

// A view of `t` with `t`'s strides stretched to `shape` (0 where broadcast).
TensorView broadcast_view(const Tensor& t, const Shape& shape) {
  // Checked here, not only by the output's view(): which argument of a
  // kernel call is built first is up to the compiler.
  if (shape.size() > static_cast<size_t>(kMaxDims))
    throw ShapeError(fmt::format("tensors have at most {} dimensions, got {}", kMaxDims, shape_str(shape)));
  TensorView v = t.view();
  broadcast_strides_into(t.shape(), t.strides(), shape.size(), v.strides);
  v.ndim = static_cast<int>(shape.size());
  std::copy(shape.begin(), shape.end(), v.shape);
  return v;
}


// Strides for viewing (shape, strides) as `to`, when no copy is needed.
std::optional<Shape> view_strides(const Shape& old_shape, const Shape& old_strides, const Shape& to) {
  Shape out(to.size());
  if (numel(old_shape) == 0 || old_shape.empty()) return contiguous_strides(to);
  int64_t view_d = static_cast<int64_t>(to.size()) - 1;
  int64_t chunk_base_stride = old_strides.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t d = static_cast<int64_t>(old_shape.size()) - 1; d >= 0; --d) {
    tensor_numel *= old_shape[d];
    // At the start of a chunk of dimensions that are laid out contiguously
    // with each other, the new dimensions covering the chunk take its strides.
    if (d == 0 || (old_shape[d - 1] != 1 && old_strides[d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || to[view_d] == 1)) {
        out[view_d] = view_numel * chunk_base_stride;
        view_numel *= to[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (d > 0) {
        chunk_base_stride = old_strides[d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return out;
}

Shape infer_shape(const Tensor& t, Shape shape, const char* op) {
  int64_t known = 1;
  int infer = -1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      check<ShapeError>(infer < 0, "{}: only one dimension can be -1 in {}", op, shape_str(shape));
      infer = static_cast<int>(i);
    } else {
      check<ShapeError>(shape[i] >= 0, "{}: invalid shape {}", op, shape_str(shape));
      check<ShapeError>(!__builtin_mul_overflow(known, shape[i], &known), "{}: shape {} has more elements than an "
                        "int64 can count", op, shape_str(shape));
    }
  }
  if (infer >= 0) {
    check<ShapeError>(known != 0 && t.numel() % known == 0, "{}: cannot view {} as {}", op, describe(t),
                      shape_str(shape));
    shape[infer] = t.numel() / known;
  }
  check<ShapeError>(numel(shape) == t.numel(), "{}: shape {} has {} elements, but the tensor {} has {}", op,
                    shape_str(shape), numel(shape), describe(t), t.numel());
  return shape;
}

Tensor with_layout(const Tensor& t, Shape shape, Shape strides, int64_t offset) {
  return Tensor::view_of(t.storage(), std::move(shape), std::move(strides), offset, t.dtype());
}

}  // namespace

// ---- creation ----------------------------------------------------------------

Tensor zeros(const Shape& shape, DType dtype, const Device& device) { return full(shape, 0.0, dtype, device); }
Tensor ones(const Shape& shape, DType dtype, const Device& device) { return full(shape, 1.0, dtype, device); }

Tensor full(const Shape& shape, double value, DType dtype, const Device& device) {
  Tensor t = Tensor::empty(shape, dtype, device);
  prim::fill_(t, value);
  return t;
}

Tensor arange(double start, double end, double step, DType dtype, const Device& device) {
  check(std::isfinite(start) && std::isfinite(end) && std::isfinite(step) && step != 0.0,
        "arange: start {}, end {} and step {} must be finite and the step non-zero", start, end, step);
  const double count = std::max(0.0, std::ceil((end - start) / step));
  check(count <= 9.0e15, "arange: [{}, {}) in steps of {} has {} elements, too many", start, end, step, count);
  const auto n = static_cast<int64_t>(count);
  Tensor t = Tensor::empty({n}, dtype, device);
  if (n > 0) on_device(device, [&](Backend& b) { b.arange(t.view(), start, step); });
  return t;
}

Tensor randn(const Shape& shape, DType dtype, const Device& device, Generator* gen) {
  Generator& g = gen ? *gen : default_generator();
  Tensor t = Tensor::empty(shape, dtype, device);
  check_floating("randn", t);
  const uint64_t offset = g.take(t.numel());
  if (t.numel() > 0) on_device(device, [&](Backend& b) { b.normal(t.view(), g.seed(), offset, 0.0, 1.0); });
  return t;
}

Tensor rand(const Shape& shape, DType dtype, const Device& device, Generator* gen, double low, double high) {
  Generator& g = gen ? *gen : default_generator();
  Tensor t = Tensor::empty(shape, dtype, device);
  check_floating("rand", t);
  const uint64_t offset = g.take(t.numel());
  if (t.numel() > 0) on_device(device, [&](Backend& b) { b.uniform(t.view(), g.seed(), offset, low, high); });
  return t;
}

template <typename T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape, DType dtype, const Device& device) {
  check<ShapeError>(static_cast<int64_t>(values.size()) == numel(shape),
                    "from_vector: {} values do not fill shape {} ({} elements)", values.size(), shape_str(shape),
                    numel(shape));
  DType host_dtype;
  if constexpr (std::is_same_v<T, float>) host_dtype = DType::f32;
  else if constexpr (std::is_same_v<T, double>) host_dtype = DType::f64;
  else if constexpr (std::is_same_v<T, Half>) host_dtype = DType::f16;
  else if constexpr (std::is_same_v<T, BFloat16>) host_dtype = DType::bf16;
  else if constexpr (std::is_same_v<T, int32_t>) host_dtype = DType::i32;
  else if constexpr (std::is_same_v<T, int64_t>) host_dtype = DType::i64;
  else if constexpr (std::is_same_v<T, Float8E4M3>) host_dtype = DType::e4m3;
  else if constexpr (std::is_same_v<T, Float8E5M2>) host_dtype = DType::e5m2;
  else host_dtype = DType::u8;
  Tensor host = Tensor::empty(shape, host_dtype, kCPU);
  if (!values.empty()) std::memcpy(host.data_ptr(), values.data(), values.size() * sizeof(T));
  return prim::to(prim::to(host, dtype), device);
}
template Tensor from_vector(const std::vector<float>&, const Shape&, DType, const Device&);
template Tensor from_vector(const std::vector<double>&, const Shape&, DType, const Device&);
template Tensor from_vector(const std::vector<Half>&, const Shape&, DType, const Device&);
template Tensor from_vector(const std::vector<BFloat16>&, const Shape&, DType, const Device&);
template Tensor from_vector(const std::vector<int32_t>&, const Shape&, DType, const Device&);
template Tensor from_vector(const std::vector<int64_t>&, const Shape&, DType, const Device&);
template Tensor from_vector(const std::vector<uint8_t>&, const Shape&, DType, const Device&);
template Tensor from_vector(const std::vector<Float8E4M3>&, const Shape&, DType, const Device&);
template Tensor from_vector(const std::vector<Float8E5M2>&, const Shape&, DType, const Device&);

Tensor from_vector(const std::vector<float>& values, const Shape& shape, const Device& device) {
  return from_vector<float>(values, shape, DType::f32, device);
}

Tensor scalar_tensor(double value, DType dtype, const Device& device) { return full({}, value, dtype, device); }

namespace prim {

// ---- copies and conversions -----------------------------------------------------

void fill_(const Tensor& dst, double value) {
  dst.bump_version();
  if (dst.numel() == 0) return;
  on_device(dst.device(), [&](Backend& b) { b.fill(dst.view(), value); });
}

void scaled_copy_list_(const std::vector<Tensor>& dsts, const std::vector<Tensor>& srcs, double scale) {
  check(dsts.size() == srcs.size(), "scaled_copy_list_: {} destinations for {} sources", dsts.size(), srcs.size());
  if (dsts.empty()) return;
  const DType dst_dtype = dsts.front().dtype(), src_dtype = srcs.front().dtype();
  auto listable = [](DType d) { return d == DType::f32 || d == DType::f16 || d == DType::bf16; };
  std::vector<TensorView> listed_dsts, listed_srcs;
  for (size_t i = 0; i < dsts.size(); ++i) {
    const Tensor &dst = dsts[i], &src = srcs[i];
    check<ShapeError>(dst.shape() == src.shape(), "scaled_copy_list_: source {} does not fit destination {}",
                      describe(src), describe(dst));
    check_same_device("scaled_copy_list_", dst, src);
    check_no_float8("scaled_copy_list_", dst);  // a scaled cast to float8 is the recipes' own, saturating one
    check_no_float8("scaled_copy_list_", src);
    const bool listed = dst.device() == dsts.front().device() && dst.dtype() == dst_dtype &&
                        src.dtype() == src_dtype && listable(dst_dtype) && listable(src_dtype) &&
                        dst.is_contiguous() && src.is_contiguous();
    if (listed) {
      dst.bump_version();
      listed_dsts.push_back(dst.view());
      listed_srcs.push_back(src.view());
    } else if (dst.dtype() == src.dtype()) {
      unary_(UnaryOp::affine, dst, src, scale, 0.0);
    } else {
      // As the kernel does: scaled in f32 (f64 if either side is), rounded once.
      const DType wide = src.dtype() == DType::f64 || dst.dtype() == DType::f64 ? DType::f64 : DType::f32;
      copy_(dst, unary(UnaryOp::affine, to(src, wide), scale, 0.0));
    }
  }
  if (!listed_dsts.empty())
    on_device(dsts.front().device(), [&](Backend& b) { b.scaled_copy_list(listed_dsts, listed_srcs, scale); });
}

void copy_(const Tensor& dst, const Tensor& src) {
  check_defined("copy_", dst);
  check_defined("copy_", src);
  const Shape shape = broadcast_shapes(dst.shape(), src.shape(), "copy_");
  check<ShapeError>(shape == dst.shape(), "copy_: source {} does not broadcast to destination {}", describe(src),
                    describe(dst));
  check_no_internal_overlap("copy_", dst);
  check_no_partial_overlap("copy_", dst, src);
  dst.bump_version();
  if (dst.numel() == 0) return;
  const bool same_memory_space = dst.device() == src.device() || (dst.device().is_cpu() && src.device().is_cpu());
  if (same_memory_space) {
    on_device(dst.device(), [&](Backend& b) { b.copy(dst.view(), broadcast_view(src, shape)); });
    return;
  }
  // Across devices: make the source a dense block of the destination's
  // shape on its own device, move the bytes, convert on the destination.
  Tensor dense = src;
  if (src.shape() != shape || !src.is_contiguous()) dense = contiguous(expand(src, shape));
  if (dst.is_contiguous() && dst.dtype() == src.dtype()) {
    memcpy_between(dst.data_ptr(), dst.device(), dense.data_ptr(), dense.device(), dense.nbytes());
    return;
  }
  Tensor staging = Tensor::empty(shape, src.dtype(), dst.device());
  memcpy_between(staging.data_ptr(), staging.device(), dense.data_ptr(), dense.device(), dense.nbytes());
  copy_(dst, staging);
}

Tensor to(const Tensor& t, const Device& device) {
  check_defined("to", t);
  if (t.device() == device) return t;
  check_device_available(device);
  Tensor out = Tensor::empty(t.shape(), t.dtype(), device);
  copy_(out, t);
  return out;
}

Tensor to(const Tensor& t, DType dtype) {
  check_defined("to", t);
  if (t.dtype() == dtype) return t;
  // The copy in dtype that the kernel which wrote t left with its memory
  // (Storage::NarrowCopy), if there is one: the same bits as the cast.
  if (t.is_contiguous())
    if (std::shared_ptr<Storage> copy = t.storage()->take_narrow_copy(dtype, t.offset(), t.numel()))
      return Tensor::view_of(std::move(copy), t.shape(), contiguous_strides(t.shape()), 0, dtype);
  Tensor out = Tensor::empty(t.shape(), dtype, t.device());
  copy_(out, t);
  return out;
}

Tensor contiguous(const Tensor& t) {
  check_defined("contiguous", t);
  return t.is_contiguous() ? t : clone(t);
}

Tensor clone(const Tensor& t) {
  check_defined("clone", t);
  Tensor out = Tensor::empty(t.shape(), t.dtype(), t.device());
  copy_(out, t);
  return out;
}

// ---- views ----------------------------------------------------------------------

Tensor view(const Tensor& t, Shape shape) {
  check_defined("view", t);
  shape = infer_shape(t, std::move(shape), "view");
  auto strides = view_strides(t.shape(), t.strides(), shape);
  check<ShapeError>(strides.has_value(),
                    "view: {} with strides {} cannot be viewed as {} without a copy (use reshape)", describe(t),
                    shape_str(t.strides()), shape_str(shape));
  return with_layout(t, std::move(shape), std::move(*strides), t.offset());
}

Tensor reshape(const Tensor& t, Shape shape) {
  check_defined("reshape", t);
  shape = infer_shape(t, std::move(shape), "reshape");
  if (auto strides = view_strides(t.shape(), t.strides(), shape))
    return with_layout(t, std::move(shape), std::move(*strides), t.offset());
  return view(clone(t), std::move(shape));
}

Tensor transpose(const Tensor& t, int64_t d0, int64_t d1) {
  check_defined("transpose", t);
  const int a = normalize_dim(d0, t.dim(), "transpose"), b = normalize_dim(d1, t.dim(), "transpose");
  Shape shape = t.shape(), strides = t.strides();
  if (t.dim() == 0) return t;
  std::swap(shape[a], shape[b]);
  std::swap(strides[a], strides[b]);
  return with_layout(t, std::move(shape), std::move(strides), t.offset());
}

Tensor permute(const Tensor& t, const std::vector<int64_t>& dims) {
  check_defined("permute", t);
  check<ShapeError>(static_cast<int64_t>(dims.size()) == t.dim(), "permute: {} dimensions given for {}", dims.size(),
                    describe(t));
  Shape shape(dims.size()), strides(dims.size());
  std::vector<bool> seen(dims.size(), false);
  for (size_t i = 0; i < dims.size(); ++i) {
    const int d = normalize_dim(dims[i], t.dim(), "permute");
    check<ShapeError>(!seen[d], "permute: dimension {} repeated", d);
    seen[d] = true;
    shape[i] = t.shape()[d];
    strides[i] = t.strides()[d];
  }
  return with_layout(t, std::move(shape), std::move(strides), t.offset());
}

Tensor slice(const Tensor& t, int64_t dim, int64_t start, int64_t end, int64_t step) {
  check_defined("slice", t);
  const int d = normalize_existing_dim(dim, t.dim(), "slice");
  check<ValueError>(step > 0, "slice: step must be positive, got {}", step);
  const int64_t n = t.shape()[d];
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  Shape shape = t.shape(), strides = t.strides();
  shape[d] = end > start ? (end - start - 1) / step + 1 : 0;  // not (end - start + step - 1): it overflows for huge steps
  strides[d] *= step;
  return with_layout(t, std::move(shape), std::move(strides), t.offset() + start * t.strides()[d]);
}

std::optional<Tensor> joined_slices(const std::vector<Tensor>& parts, int64_t dim, int64_t size, const Shape& whole) {
  if (parts.empty() || !parts[0].defined()) return std::nullopt;
  const int d = normalize_existing_dim(dim, static_cast<int64_t>(whole.size()), "joined_slices");
  const Tensor& first = parts[0];
  const Shape strides = contiguous_strides(whole);
  // Each part: the slice of a contiguous `whole` at first's offset.
  for (size_t i = 0; i < parts.size(); ++i) {
    const Tensor& p = parts[i];
    const int64_t start = static_cast<int64_t>(i) * size;
    Shape shape = whole;
    shape[d] = std::min(size, whole[d] - start);
    if (!p.defined() || p.storage() != first.storage() || p.dtype() != first.dtype() || p.shape() != shape ||
        p.offset() != first.offset() + start * strides[d])
      return std::nullopt;
    for (size_t k = 0; k < whole.size(); ++k)
      if (shape[k] > 1 && p.strides()[k] != strides[k]) return std::nullopt;
  }
  if (static_cast<int64_t>(parts.size()) * size < whole[d]) return std::nullopt;
  return with_layout(first, whole, strides, first.offset());
}

Tensor expand(const Tensor& t, const Shape& shape) {
  check_defined("expand", t);
  check<ShapeError>(std::ranges::all_of(shape, [](int64_t d) { return d >= 0; }),
                    "expand: {} cannot be expanded to {}: sizes must be given (no -1)", describe(t), shape_str(shape));
  const Shape b = broadcast_shapes(t.shape(), shape, "expand");
  check<ShapeError>(b == shape, "expand: {} cannot be expanded to {}", describe(t), shape_str(shape));
  return with_layout(t, shape, broadcast_strides(t.shape(), t.strides(), shape), t.offset());
}

Tensor unsqueeze(const Tensor& t, int64_t dim) {
  check_defined("unsqueeze", t);
  const int d = normalize_dim(dim, t.dim() + 1, "unsqueeze");
  Shape shape = t.shape(), strides = t.strides();
  const int64_t stride = d < t.dim() ? t.shape()[d] * t.strides()[d] : 1;
  shape.insert(shape.begin() + d, 1);
  strides.insert(strides.begin() + d, stride);
  return with_layout(t, std::move(shape), std::move(strides), t.offset());
}

Tensor squeeze(const Tensor& t, int64_t dim) {
  check_defined("squeeze", t);
  const int d = normalize_dim(dim, t.dim(), "squeeze");
  if (t.dim() == 0 || t.shape()[d] != 1) return t;
  Shape shape = t.shape(), strides = t.strides();
  shape.erase(shape.begin() + d);
  strides.erase(strides.begin() + d);
  return with_layout(t, std::move(shape), std::move(strides), t.offset());
}

// ---- element-wise -------------------------------------------------------------------
// (The checks run on every call: their messages are made only for a failure.)

void unary_(UnaryOp op, const Tensor& out, const Tensor& x, double alpha, double beta) {
  const char* name = unary_op_name(op);
  check_same_device(name, out, x);
  check_floating(name, x);
  if (out.dtype() != x.dtype())
    throw DTypeError(fmt::format("{}: output {} and input {} differ in dtype", name, describe(out), describe(x)));
  if (broadcast_shapes(out.shape(), x.shape(), name) != out.shape())
    throw ShapeError(fmt::format("{}: input {} does not broadcast to output {}", name, describe(x), describe(out)));
  check_no_internal_overlap(name, out);
  check_no_partial_overlap(name, out, x);
  out.bump_version();
  if (out.numel() == 0) return;
  on_device(out.device(), [&](Backend& b) { b.unary(op, out.view(), broadcast_view(x, out.shape()), alpha, beta); });
}

Tensor unary(UnaryOp op, const Tensor& x, double alpha, double beta) {
  check_floating(unary_op_name(op), x);
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  unary_(op, out, x, alpha, beta);
  return out;
}

namespace {

// binary_ once `out` is known to be on the operands' device with their
// broadcast shape `shape` (binary() makes it so; binary_ checks it).
void binary_into(BinaryOp op, const char* name, const Tensor& out, const Tensor& a, const Tensor& b,
                 const Shape& shape) {
  check_floating(name, out);
  check_no_internal_overlap(name, out);
  check_no_partial_overlap(name, out, a);
  check_no_partial_overlap(name, out, b);
  out.bump_version();
  if (out.numel() == 0) return;
  on_device(out.device(), [&](Backend& be) {
    // Inputs of other dtypes are converted first unless the backend
    // converts them as it loads them.
    const bool as_given = be.binary_takes_mixed(out.dtype(), a.dtype(), b.dtype());
    const Tensor ca = as_given ? a : to(a, out.dtype()), cb = as_given ? b : to(b, out.dtype());
    be.binary(op, out.view(), broadcast_view(ca, shape), broadcast_view(cb, shape));
  });
}

}  // namespace

void binary_(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  const char* name = binary_op_name(op);
  check_same_device(name, a, b);
  check_no_float8(name, a);  // (out is checked with check_floating; inputs would be converted to its dtype)
  check_no_float8(name, b);
  check_same_device(name, out, a);
  const Shape shape = broadcast_shapes(a.shape(), b.shape(), name);
  if (shape != out.shape())
    throw ShapeError(fmt::format("{}: output {} does not have the broadcast shape {} of {} and {}", name,
                                 describe(out), shape_str(shape), describe(a), describe(b)));
  binary_into(op, name, out, a, b, shape);
}

Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b) {
  const char* name = binary_op_name(op);
  check_same_device(name, a, b);
  check_no_float8(name, a);  // before promote(), whose message would not name the op
  check_no_float8(name, b);
  const DType dtype = promote(a.dtype(), b.dtype());
  if (!is_floating(dtype))
    throw DTypeError(fmt::format("{}: expected floating operands, got {} and {}", name, describe(a), describe(b)));
  const Shape shape = broadcast_shapes(a.shape(), b.shape(), name);
  Tensor out = Tensor::empty(shape, dtype, a.device());
  binary_into(op, name, out, a, b, shape);
  return out;
}

// ---- reductions ---------------------------------------------------------------------

Tensor reduce(ReduceOp op, const Tensor& x, const std::vector<int64_t>& dims_in, bool keepdim) {
  const char* name = reduce_op_name(op);
  check_floating(name, x);
  const int64_t nd = x.dim();
  std::vector<bool> reduced(static_cast<size_t>(nd), dims_in.empty());
  for (int64_t d : dims_in) {
    const int n = normalize_dim(d, nd, name);
    check<ShapeError>(nd == 0 || !reduced[n], "{}: dimension {} repeated in the dimensions of {}",
                      name, d, describe(x));
    if (nd > 0) reduced[n] = true;
  }
  Shape out_shape;
  int64_t k = 1;
  for (int64_t d = 0; d < nd; ++d) {
    if (reduced[d]) {
      k *= x.shape()[d];
      if (keepdim) out_shape.push_back(1);
    } else {
      out_shape.push_back(x.shape()[d]);
    }
  }
  const DType out_dtype = op == ReduceOp::argmax ? DType::i64 : x.dtype();
  Tensor out = Tensor::empty(out_shape, out_dtype, x.device());
  if (out.numel() == 0) return out;
  if (k == 0) {
    check<ShapeError>(op == ReduceOp::sum || op == ReduceOp::mean, "{}: cannot reduce {} over an empty dimension",
                      name, describe(x));
    fill_(out, op == ReduceOp::sum ? 0.0 : std::nan(""));
    return out;
  }
  // Lay the input out as [outer, k, inner]: in place when the reduced
  // dimensions are one contiguous run of a contiguous tensor, otherwise by
  // moving them last and copying.
  int first = -1, last = -1;
  for (int64_t d = 0; d < nd; ++d)
    if (reduced[d] && x.shape()[d] != 1) {
      if (first < 0) first = static_cast<int>(d);
      last = static_cast<int>(d);
    }
  bool run = true;
  for (int d = first; first >= 0 && d <= last; ++d) run = run && (reduced[d] || x.shape()[d] == 1);
  Tensor src = x;
  int64_t outer = 1, inner = 1;
  if (x.is_contiguous() && run) {
    for (int d = 0; d < first; ++d) outer *= x.shape()[d];
    for (int64_t d = last + 1; first >= 0 && d < nd; ++d) inner *= x.shape()[d];
    if (first < 0) outer = x.numel();  // only size-1 dimensions reduced
  } else {
    std::vector<int64_t> order;
    for (int64_t d = 0; d < nd; ++d)
      if (!reduced[d]) order.push_back(d);
    for (int64_t d = 0; d < nd; ++d)
      if (reduced[d]) order.push_back(d);
    src = contiguous(permute(x, order));
    outer = x.numel() / k;
  }
  on_device(x.device(), [&](Backend& b) { b.reduce(op, out.view(), src.view(), outer, k, inner); });
  return out;
}

Tensor argmax(const Tensor& x, int64_t dim, bool keepdim) {
  return reduce(ReduceOp::argmax, x, {dim}, keepdim);
}

// ---- matrix products ------------------------------------------------------------------

namespace {

// Folds all leading (batch) dimensions of a view into one, if its strides
// allow; returns the fold's stride.
std::optional<int64_t> fold_batch(const Shape& shape, const Shape& strides, size_t batch_dims) {
  int64_t stride = 0;
  bool any = false;
  for (size_t i = batch_dims; i-- > 0;) {
    if (shape[i] == 1) continue;
    if (!any) {
      stride = strides[i];
      any = true;
      continue;
    }
    // The next-outer dimension must step over everything inside it.
    int64_t inner_span = 1;
    for (size_t j = i + 1; j < batch_dims; ++j) inner_span *= shape[j];
    if (strides[i] != stride * inner_span) return std::nullopt;
  }
  return stride;
}

// A matrix operand as a 3-d view [batch, rows, cols] with a unit stride in
// one of the last two dimensions (copying when that is not already so).
// `t` is replaced by the tensor the view points into, to keep it alive.
TensorView gemm_operand(Tensor& t, const Shape& batch, int64_t batch_count) {
  Shape full = batch;
  full.push_back(t.shape()[t.dim() - 2]);
  full.push_back(t.shape()[t.dim() - 1]);
  t = expand(t, full);
  auto unit_inner = [&](const Tensor& x) {
    const int64_t rs = x.strides()[x.dim() - 2], cs = x.strides()[x.dim() - 1];
    const int64_t rows = x.shape()[x.dim() - 2], cols = x.shape()[x.dim() - 1];
    return (cs == 1 && (rs >= cols || rows == 1)) || (rs == 1 && (cs >= rows || cols == 1));
  };
  auto stride = fold_batch(t.shape(), t.strides(), batch.size());
  if (!unit_inner(t) || !stride) {
    t = contiguous(t);
    stride = fold_batch(t.shape(), t.strides(), batch.size());
  }
  TensorView v = t.view();
  const int nd = v.ndim;
  TensorView out = v;
  out.ndim = 3;
  out.shape[0] = batch_count;
  out.strides[0] = batch_count == 1 ? 0 : *stride;
  out.shape[1] = v.shape[nd - 2];
  out.strides[1] = v.strides[nd - 2];
  out.shape[2] = v.shape[nd - 1];
  out.strides[2] = v.strides[nd - 1];
  return out;
}

// The GEMM out = a @ b over `batch` (a and b are replaced by what their
// views point into); out is contiguous.
GemmArgs gemm_args(Tensor& a, Tensor& b, const Tensor& out, const Shape& batch, int64_t batch_count) {
  GemmArgs g;
  g.a = gemm_operand(a, batch, batch_count);
  g.b = gemm_operand(b, batch, batch_count);
  const int64_t n = g.b.shape[2];
  g.out = out.view();
  g.out.ndim = 3;
  g.out.shape[0] = batch_count;
  g.out.strides[0] = g.a.shape[1] * n;
  g.out.shape[1] = g.a.shape[1];
  g.out.strides[1] = n;
  g.out.shape[2] = n;
  g.out.strides[2] = 1;
  return g;
}

}  // namespace

Tensor matmul(const Tensor& a_in, const Tensor& b_in) {
  check_same_device("matmul", a_in, b_in);
  check<ShapeError>(a_in.dim() >= 2 && b_in.dim() >= 2, "matmul: expects operands of at least 2 dimensions, got {} and {}",
                    describe(a_in), describe(b_in));
  check<DTypeError>(a_in.dtype() == b_in.dtype(), "matmul: operands differ in dtype: {} and {}", describe(a_in),
                    describe(b_in));
  check_floating("matmul", a_in);
  const int64_t m = a_in.shape()[a_in.dim() - 2], k = a_in.shape()[a_in.dim() - 1];
  const int64_t k2 = b_in.shape()[b_in.dim() - 2], n = b_in.shape()[b_in.dim() - 1];
  check<ShapeError>(k == k2, "matmul: inner dimensions differ: {} @ {} ({} vs {})", describe(a_in), describe(b_in), k,
                    k2);
  Tensor a = a_in, b = b_in;
  Shape out_shape;
  // [..., m, k] @ [k, n] with contiguous rows: one GEMM over all rows
  // (k > 0: an [..., m, 0] tensor has no row length to view it by).
  if (b.dim() == 2 && a.dim() > 2 && a.is_contiguous() && k > 0) {
    out_shape = Shape(a.shape().begin(), a.shape().end() - 1);
    out_shape.push_back(n);
    a = view(a, {-1, k});
  } else {
    const Shape ba(a.shape().begin(), a.shape().end() - 2), bb(b.shape().begin(), b.shape().end() - 2);
    out_shape = broadcast_shapes(ba, bb, "matmul");
    out_shape.push_back(m);
    out_shape.push_back(n);
  }
  Tensor out = Tensor::empty(out_shape, a.dtype(), a.device());
  if (out.numel() == 0) return out;
  if (k == 0) {
    fill_(out, 0.0);
    return out;
  }
  const Shape batch(out_shape.begin(), out_shape.end() - 2);
  const int64_t batch_count = a.dim() == 2 && b.dim() == 2 ? 1 : numel(batch);
  const Shape gemm_batch = a.dim() == 2 && b.dim() == 2 ? Shape{} : batch;
  GemmArgs g = gemm_args(a, b, out, gemm_batch, batch_count);
  on_device(a.device(), [&](Backend& be) { be.gemm(g); });
  return out;
}

Tensor linear(const Tensor& x_in, const Tensor& weight, const Tensor& bias, bool relu) {
  check_same_device("linear", x_in, weight);
  check<ShapeError>(x_in.dim() == 2 && weight.dim() == 2 && x_in.shape()[1] == weight.shape()[1],
                    "linear: input {} does not match weight {} (expected [rows, {}])", describe(x_in),
                    describe(weight), weight.dim() == 2 ? weight.shape()[1] : -1);
  check<DTypeError>(x_in.dtype() == weight.dtype() && (!bias.defined() || bias.dtype() == weight.dtype()),
                    "linear: operands differ in dtype: {}, {}, {}", describe(x_in), describe(weight), describe(bias));
  check<ShapeError>(!bias.defined() || (bias.dim() == 1 && bias.shape()[0] == weight.shape()[0]),
                    "linear: bias {} does not match weight {}", describe(bias), describe(weight));
  if (bias.defined()) check_same_device("linear", x_in, bias);
  check_floating("linear", x_in);
  Tensor x = x_in, w_t = transpose(weight, 0, 1);
  Tensor out = Tensor::empty({x.shape()[0], weight.shape()[0]}, x.dtype(), x.device());
  if (out.numel() == 0) return out;
  if (x.shape()[1] == 0) {  // an empty product: only the bias remains
    const Tensor only_bias =
        bias.defined() ? contiguous(expand(bias, out.shape())) : zeros(out.shape(), out.dtype(), out.device());
    return relu ? unary(UnaryOp::relu, only_bias) : only_bias;
  }
  GemmArgs g = gemm_args(x, w_t, out, {}, 1);
  const Tensor b = bias.defined() ? contiguous(bias) : Tensor();
  if (b.defined()) g.bias = b.view();
  g.relu = relu;
  on_device(x.device(), [&](Backend& be) { be.gemm(g); });
  return out;
}

std::pair<Tensor, Tensor> linear_weight_grad(const Tensor& grad, const Tensor& x_in, bool with_bias) {
  check_same_device("linear_weight_grad", grad, x_in);
  check<ShapeError>(grad.dim() == 2 && x_in.dim() == 2 && grad.shape()[0] == x_in.shape()[0],
                    "linear_weight_grad: gradient {} and input {} must be [rows, out] and [rows, in]", describe(grad),
                    describe(x_in));
  check<DTypeError>(grad.dtype() == x_in.dtype(), "linear_weight_grad: gradient {} and input {} differ in dtype",
                    describe(grad), describe(x_in));
  check_floating("linear_weight_grad", x_in);
  Tensor grad_t = transpose(grad, 0, 1), x = x_in;
  Tensor weight_grad = Tensor::empty({grad.shape()[1], x.shape()[1]}, x.dtype(), x.device());
  Tensor bias_grad = with_bias ? Tensor::empty({grad.shape()[1]}, x.dtype(), x.device()) : Tensor();
  if (grad.shape()[0] == 0) {  // no rows: both sums are empty
    fill_(weight_grad, 0.0);
    if (with_bias) fill_(bias_grad, 0.0);
    return {weight_grad, bias_grad};
  }
  if (weight_grad.numel() == 0) {
    if (with_bias) bias_grad = to(sum(grad, {0}), x.dtype());
    return {weight_grad, bias_grad};
  }
  GemmArgs g = gemm_args(grad_t, x, weight_grad, {}, 1);
  if (with_bias) g.bias_grad = bias_grad.view();
  on_device(x.device(), [&](Backend& be) { be.gemm(g); });
  return {weight_grad, bias_grad};
}

}  // namespace prim
}  // namespace mpt
