#pragma once
// Tensor: a shared handle to (storage, shape, strides, offset, dtype) plus the
// autograd slot. Copying a Tensor copies the handle, not the data. Views
// (transpose, slice, reshape of contiguous data) share storage.
//
// The member functions here never record autograd history; the
// differentiable ops live in autograd/ops.h. Raw, non-differentiable tensor
// arithmetic lives in tensor/ops.h (namespace mpt::prim).
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tensor/device.h"
#include "tensor/dtype.h"
#include "tensor/error.h"
#include "tensor/fp8.h"
#include "tensor/half.h"
#include "tensor/shape.h"
#include "tensor/storage.h"
#include "tensor/tensor_view.h"

namespace mpt {

class Node;           // autograd graph node (autograd/node.h)
struct AutogradMeta;  // below

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Shape shape;
  int64_t numel = 0;  // of shape, counted when it is set (every op asks, and counting checks for overflow)
  Shape strides;
  int64_t offset = 0;  // in elements
  DType dtype = DType::f32;
  std::shared_ptr<AutogradMeta> autograd;  // null until autograd needs it
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // Uninitialised contiguous tensor.
  static Tensor empty(const Shape& shape, DType dtype = DType::f32, const Device& device = kCPU);
  // A view of existing storage.
  static Tensor view_of(std::shared_ptr<Storage> storage, Shape shape, Shape strides, int64_t offset,
                        DType dtype);

  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const { return impl().shape; }
  const Shape& strides() const { return impl().strides; }
  int64_t dim() const { return static_cast<int64_t>(impl().shape.size()); }
  int64_t size(int64_t d) const;
  int64_t numel() const { return impl().numel; }
  int64_t offset() const { return impl().offset; }
  DType dtype() const { return impl().dtype; }
  const Device& device() const { return impl().storage->device(); }
  size_t element_size() const { return dtype_size(dtype()); }
  size_t nbytes() const { return numel() * element_size(); }
  bool is_contiguous() const;
  const std::shared_ptr<Storage>& storage() const { return impl().storage; }
  // The storage's version (tensor/storage.h): every in-place write through
  // the tensor API raises it. Code that writes through data_ptr() or its own
  // kernels calls bump_version() afterwards, so that autograd notices.
  uint64_t version() const { return impl().storage->version(); }
  void bump_version() const { impl().storage->bump_version(); }
  // Same storage, same view: the same tensor.
  bool is_same(const Tensor& o) const { return impl_ == o.impl_; }

  void* data_ptr() const;
  template <typename T>
  T* data() const;  // checks that T matches dtype()
  TensorView view() const;  // throws ShapeError beyond kMaxDims dimensions

  // Host values, converted to T (any tensor, any device: copies to the host).
  template <typename T>
  std::vector<T> to_vector() const;
  // The single element of a one-element tensor, as a double.
  double item() const;
  std::string str() const;  // values and metadata, PyTorch-like

  // Inline: every accessor (shape, dtype, data) goes through it, many times an op.
  TensorImpl& impl() const {
    if (!impl_) [[unlikely]]
      throw_undefined();
    return *impl_;
  }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }

  // Autograd slot (autograd/ fills it in; plain data here).
  bool requires_grad() const;
  Tensor& set_requires_grad(bool on);
  Tensor grad() const;  // undefined when none has been accumulated
  void set_grad(const Tensor& g);
  std::shared_ptr<Node> grad_fn() const;
  AutogradMeta& autograd_meta() const;  // created on first use

 private:
  [[noreturn]] static void throw_undefined();

  std::shared_ptr<TensorImpl> impl_;
};

// The autograd slot's contents; the engine that uses it is in autograd/.
struct AutogradMeta {
  bool requires_grad = false;
  Tensor grad;
  std::shared_ptr<Node> grad_fn;        // the node that produced this tensor (null for a leaf)
  uint32_t output_nr = 0;               // which output of grad_fn
  std::weak_ptr<Node> grad_accumulator;  // a leaf's gradient sink, while a graph uses it
  // Called after this leaf's gradient has been accumulated in a backward
  // pass (data parallelism starts communication from here).
  std::vector<std::function<void(const Tensor&)>> post_accumulate_hooks;
  // Hooks called after those, that only queue GPU work on the current
  // stream and order other streams after it with events (data
  // parallelism's), so the sink may run on backward's side stream
  // (autograd/beside.h); any other hook keeps it on backward's own.
  std::vector<std::function<void(const Tensor&)>> stream_ordered_post_accumulate_hooks;
  std::string name;  // parameter name, for messages and traces
};

std::ostream& operator<<(std::ostream& os, const Tensor& t);

// A tensor's "f32[2, 3] on cpu" (or "undefined tensor"), written out only
// when it is formatted or made a string. Operand checks run on every call
// of an op and pass descriptions to a message that is built only when the
// check fails, so a passing check costs a handle copy, not a string. It
// holds the handle, so it stays valid wherever it is kept.
class TensorDescription {
 public:
  explicit TensorDescription(Tensor t) : tensor_(std::move(t)) {}
  std::string str() const;
  operator std::string() const { return str(); }  // NOLINT: a description is text wherever text is asked for

 private:
  Tensor tensor_;
};

TensorDescription describe(const Tensor& t);
std::ostream& operator<<(std::ostream& os, const TensorDescription& d);

}  // namespace mpt

template <>
struct fmt::formatter<mpt::TensorDescription> : fmt::formatter<std::string_view> {
  auto format(const mpt::TensorDescription& d, fmt::format_context& ctx) const {
    return fmt::formatter<std::string_view>::format(d.str(), ctx);
  }
};
