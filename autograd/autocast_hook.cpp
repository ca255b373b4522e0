#include "autograd/autocast_hook.h"

namespace mpt {
namespace {
thread_local AutocastHandler* t_handler = nullptr;
}

void set_autocast_handler(AutocastHandler* handler) { t_handler = handler; }

DType autocast_input_dtype(const char* op, const Tensor& x) {
  return t_handler && x.defined() ? t_handler->input_dtype(op, x) : x.dtype();
}

AutocastSuspendGuard::AutocastSuspendGuard() : previous_(t_handler) { t_handler = nullptr; }
AutocastSuspendGuard::~AutocastSuspendGuard() { t_handler = previous_; }

AutocastOp::AutocastOp(const char* op, std::initializer_list<const Tensor*> inputs) {
  AutocastHandler* handler = t_handler;
  if (!handler) return;
  std::vector<Tensor> given;
  given.reserve(inputs.size());
  for (const Tensor* t : inputs) given.push_back(*t);
  cast_ = handler->cast_inputs(op, given);
  suspend_.emplace();
  active_ = true;
}

AutocastOp::AutocastOp(const char* op, const std::vector<Tensor>& inputs) {
  AutocastHandler* handler = t_handler;
  if (!handler) return;
  cast_ = handler->cast_inputs(op, inputs);
  suspend_.emplace();
  active_ = true;
}

}  // namespace mpt
