#pragma once
// The seam through which automatic mixed precision (amp/autocast.h) reaches
// the differentiable ops without autograd knowing amp.
//
// Each op that autocast may re-type starts with
//
//   if (AutocastOp ac{"linear", {&x, &weight, &bias}}) return linear(ac[0], ac[1], ac[2]);
//
// When this thread has an autocast handler installed, the handler casts the
// floating inputs as its policy says for "linear" (with the differentiable
// `to`, so backward runs in the dtypes forward chose), and the op calls
// itself again with autocast suspended, so the ops it is built from run as
// written rather than being re-typed one by one (PyTorch's autocast also
// acts only at the outermost op). Without a handler the check is one
// thread-local load and the op runs as usual.
#include <initializer_list>
#include <optional>
#include <vector>

#include "tensor/tensor.h"

namespace mpt {

// Implemented by amp/: decides each input's dtype for an op.
class AutocastHandler {
 public:
  virtual ~AutocastHandler() = default;
  // Returns the inputs to use for `op` (same order and count; undefined
  // and non-floating inputs are passed through).
  virtual std::vector<Tensor> cast_inputs(const char* op, const std::vector<Tensor>& inputs) = 0;
  // The dtype cast_inputs would give `x` as the only floating input of `op`.
  virtual DType input_dtype(const char* op, const Tensor& x) = 0;
};

// Installs this thread's handler (null: autocast is off). amp/ installs and
// removes it.
void set_autocast_handler(AutocastHandler* handler);

// The dtype autocast would give `x` as an input of `op` on this thread (x's
// own where autocast is off, suspended or leaves it alone): lets a producer
// write its result in the dtype its consumer computes in.
DType autocast_input_dtype(const char* op, const Tensor& x);

// Suspends autocast on this thread for a scope (the body of an op that was
// already cast, or code that must run in the dtypes it was given).
class AutocastSuspendGuard {
 public:
  AutocastSuspendGuard();
  ~AutocastSuspendGuard();
  AutocastSuspendGuard(const AutocastSuspendGuard&) = delete;
  AutocastSuspendGuard& operator=(const AutocastSuspendGuard&) = delete;

 private:
  AutocastHandler* previous_;
};

// The entry check of an op (see the top of this file). True when the inputs
// were cast and the op must call itself with them; autocast stays suspended
// for the lifetime of this object.
class AutocastOp {
 public:
  AutocastOp(const char* op, std::initializer_list<const Tensor*> inputs);
  AutocastOp(const char* op, const std::vector<Tensor>& inputs);  // ops over a list (cat)
  explicit operator bool() const { return active_; }
  const Tensor& operator[](size_t i) const { return cast_.at(i); }
  const std::vector<Tensor>& inputs() const { return cast_; }

 private:
  bool active_ = false;
  std::vector<Tensor> cast_;
  std::optional<AutocastSuspendGuard> suspend_;
};

}  // namespace mpt
