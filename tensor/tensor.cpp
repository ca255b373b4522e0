#include "tensor/tensor.h"

#include <algorithm>
#include <ostream>

#include "tensor/ops.h"

namespace mpt {

Tensor Tensor::empty(const Shape& shape, DType dtype, const Device& device) {
  // (Every new tensor passes here: the messages are made only on failure.)
  if (!std::ranges::all_of(shape, [](int64_t d) { return d >= 0; }))
    throw ShapeError(fmt::format("empty: negative dimension in shape {}", shape_str(shape)));
  const int64_t count = mpt::numel(shape);
  size_t bytes = 0;
  if (__builtin_mul_overflow(static_cast<size_t>(count), dtype_size(dtype), &bytes))
    throw ShapeError(fmt::format("empty: shape {} of {} needs more bytes than a size_t can count", shape_str(shape),
                                 dtype_name(dtype)));
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = Storage::allocate(bytes, device);
  impl->shape = shape;
  impl->numel = count;
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

Tensor Tensor::view_of(std::shared_ptr<Storage> storage, Shape shape, Shape strides, int64_t offset, DType dtype) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::move(storage);
  impl->numel = mpt::numel(shape);
  impl->shape = std::move(shape);
  impl->strides = std::move(strides);
  impl->offset = offset;
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

void Tensor::throw_undefined() { throw ValueError("use of an undefined tensor"); }

int64_t Tensor::size(int64_t d) const { return shape()[normalize_existing_dim(d, dim(), "size")]; }

// Read in place: nearly every op asks, and a TensorView would copy the
// shape and strides first.
bool Tensor::is_contiguous() const {
  const TensorImpl& t = impl();
  return dense_row_major(t.shape.data(), t.strides.data(), static_cast<int>(t.shape.size()));
}

void* Tensor::data_ptr() const {
  return static_cast<char*>(impl().storage->data()) + impl().offset * static_cast<int64_t>(element_size());
}

namespace {
template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<double>() { return DType::f64; }
template <> constexpr DType dtype_of<Half>() { return DType::f16; }
template <> constexpr DType dtype_of<BFloat16>() { return DType::bf16; }
template <> constexpr DType dtype_of<int32_t>() { return DType::i32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::i64; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::u8; }
template <> constexpr DType dtype_of<Float8E4M3>() { return DType::e4m3; }
template <> constexpr DType dtype_of<Float8E5M2>() { return DType::e5m2; }
}  // namespace

template <typename T>
T* Tensor::data() const {
  check<DTypeError>(dtype() == dtype_of<T>(), "data<{}>() on a tensor of dtype {}", dtype_name(dtype_of<T>()),
                    dtype_name(dtype()));
  return static_cast<T*>(data_ptr());
}

TensorView Tensor::view() const {
  const TensorImpl& t = impl();
  check<ShapeError>(t.shape.size() <= static_cast<size_t>(kMaxDims), "tensors have at most {} dimensions, got {}",
                    kMaxDims, shape_str(t.shape));
  TensorView v;
  v.data = data_ptr();
  v.dtype = t.dtype;
  v.ndim = static_cast<int>(t.shape.size());
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[i] = t.shape[i];
    v.strides[i] = t.strides[i];
  }
  return v;
}

template <typename T>
std::vector<T> Tensor::to_vector() const {
  // Same-dtype host copy, then a host-side conversion element by element.
  const Tensor host = prim::contiguous(prim::to(*this, kCPU));
  const int64_t n = host.numel();
  std::vector<T> out(static_cast<size_t>(n));
  const void* p = host.data_ptr();
  auto read = [&](auto tag) {
    using S = decltype(tag);
    const S* s = static_cast<const S*>(p);
    for (int64_t i = 0; i < n; ++i) {
      if constexpr (std::is_same_v<T, S>) {
        out[i] = s[i];
      } else if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
        // From double, rounded once (not through float: a double or an
        // integer would round twice).
        if constexpr (std::is_same_v<S, Half> || std::is_same_v<S, BFloat16>)
          out[i] = T(static_cast<double>(static_cast<float>(s[i])));
        else
          out[i] = T(static_cast<double>(s[i]));
      } else {
        out[i] = static_cast<T>(static_cast<double>(s[i]));
      }
    }
  };
  switch (host.dtype()) {
    case DType::f32: read(float{}); break;
    case DType::f64: read(double{}); break;
    case DType::f16: read(Half{}); break;
    case DType::bf16: read(BFloat16{}); break;
    case DType::i32: read(int32_t{}); break;
    case DType::i64: read(int64_t{}); break;
    case DType::u8: read(uint8_t{}); break;
    case DType::e4m3: read(Float8E4M3{}); break;
    case DType::e5m2: read(Float8E5M2{}); break;
  }
  return out;
}

double Tensor::item() const {
  check<ShapeError>(numel() == 1, "item: the tensor has {} elements, expected 1 ({})", numel(), describe(*this));
  return to_vector<double>()[0];
}

#define MPT_INSTANTIATE(T)                      \
  template T* Tensor::data<T>() const;          \
  template std::vector<T> Tensor::to_vector<T>() const;
MPT_INSTANTIATE(float)
MPT_INSTANTIATE(double)
MPT_INSTANTIATE(Half)
MPT_INSTANTIATE(BFloat16)
MPT_INSTANTIATE(int32_t)
MPT_INSTANTIATE(int64_t)
MPT_INSTANTIATE(uint8_t)
MPT_INSTANTIATE(Float8E4M3)
MPT_INSTANTIATE(Float8E5M2)
#undef MPT_INSTANTIATE

AutogradMeta& Tensor::autograd_meta() const {
  TensorImpl& t = impl();
  if (!t.autograd) t.autograd = std::make_shared<AutogradMeta>();
  return *t.autograd;
}

bool Tensor::requires_grad() const { return impl_ && impl_->autograd && impl_->autograd->requires_grad; }

Tensor& Tensor::set_requires_grad(bool on) {
  check<DTypeError>(!on || is_floating(dtype()), "requires_grad: only floating tensors can require gradients, got {}",
                    describe(*this));
  autograd_meta().requires_grad = on;
  return *this;
}

Tensor Tensor::grad() const { return impl_ && impl_->autograd ? impl_->autograd->grad : Tensor(); }

void Tensor::set_grad(const Tensor& g) { autograd_meta().grad = g; }

std::shared_ptr<Node> Tensor::grad_fn() const {
  return impl_ && impl_->autograd ? impl_->autograd->grad_fn : nullptr;
}

std::string TensorDescription::str() const {
  if (!tensor_.defined()) return "undefined tensor";
  return fmt::format("{}{} on {}", dtype_name(tensor_.dtype()), shape_str(tensor_.shape()), tensor_.device().str());
}

TensorDescription describe(const Tensor& t) { return TensorDescription(t); }

std::ostream& operator<<(std::ostream& os, const TensorDescription& d) { return os << d.str(); }

}  // namespace mpt
