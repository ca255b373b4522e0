#include "models/module.h"

#include <unordered_set>

#include "autograd/grad_mode.h"
#include "tensor/ops.h"

namespace mpt::nn {
namespace {

std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

// Re-points t's implementation at a copy on `device`. Handles that share
// the TensorImpl (layer members, optimizers) follow; autograd meta (name,
// requires_grad, hooks) is untouched.
void move_in_place(const Tensor& t, const Device& device) {
  if (t.device() == device) return;
  const Tensor moved = prim::to(t, device);  // a fresh contiguous tensor
  TensorImpl& impl = t.impl();
  impl.storage = moved.storage();
  impl.strides = moved.strides();
  impl.offset = moved.offset();
}

}  // namespace

Tensor Module::forward(const Tensor&) {
  throw Error(fmt::format("{}: forward(const Tensor&) is not defined for this module", type_name_));
}

// ---- registration -----------------------------------------------------------------------

void Module::check_new_name(const std::string& name, const char* what) const {
  check(!name.empty(), "{}: a {} needs a non-empty name", type_name_, what);
  check(name.find('.') == std::string::npos, "{}: {} name '{}' must not contain '.' (dots separate levels)",
        type_name_, what, name);
  check(!params_.contains(name) && !buffers_.contains(name) && !children_.contains(name),
        "{}: {} name '{}' is already taken", type_name_, what, name);
}

Tensor Module::register_parameter(const std::string& name, Tensor value) {
  check_new_name(name, "parameter");
  check(value.defined(), "{}: register_parameter('{}') got an undefined tensor", type_name_, name);
  check<DTypeError>(is_floating(value.dtype()), "{}: parameter '{}' must be floating, got {}", type_name_, name,
                    describe(value));
  // Master weights are f32: the optimizer's update must not round to 16 bits.
  if (value.dtype() != DType::f32) value = prim::to(value, DType::f32);
  value.set_requires_grad(true);
  params_.insert(name, value);
  return value;
}

Tensor Module::register_buffer(const std::string& name, Tensor value) {
  check_new_name(name, "buffer");
  check(value.defined(), "{}: register_buffer('{}') got an undefined tensor", type_name_, name);
  buffers_.insert(name, value);
  return value;
}

// ---- walking ---------------------------------------------------------------------------------

void Module::collect_parameters(const std::string& prefix, OrderedDict<Tensor>& out) const {
  for (const auto& [name, p] : params_) out.insert(join(prefix, name), p);
  for (const auto& [name, child] : children_) child->collect_parameters(join(prefix, name), out);
}

void Module::collect_buffers(const std::string& prefix, OrderedDict<Tensor>& out) const {
  for (const auto& [name, b] : buffers_) out.insert(join(prefix, name), b);
  for (const auto& [name, child] : children_) child->collect_buffers(join(prefix, name), out);
}

void Module::collect_state(const std::string& prefix, OrderedDict<Tensor>& out) const {
  for (const auto& [name, p] : params_) out.insert(join(prefix, name), p);
  for (const auto& [name, b] : buffers_) out.insert(join(prefix, name), b);
  for (const auto& [name, child] : children_) child->collect_state(join(prefix, name), out);
}

void Module::collect_modules(const std::string& prefix, std::vector<std::pair<std::string, Module*>>& out) {
  out.emplace_back(prefix, this);
  for (auto& [name, child] : children_) child->collect_modules(join(prefix, name), out);
}

OrderedDict<Tensor> Module::named_parameters() const {
  OrderedDict<Tensor> all;
  collect_parameters("", all);
  // A tensor registered twice (tied weights) is one parameter: it must be
  // updated, clipped and reduced once. It keeps its first name.
  OrderedDict<Tensor> unique;
  std::unordered_set<const TensorImpl*> seen;
  for (auto& [name, p] : all) {
    if (!seen.insert(p.impl_ptr().get()).second) continue;
    p.autograd_meta().name = name;
    unique.insert(name, p);
  }
  return unique;
}

std::vector<Tensor> Module::parameters() const { return named_parameters().values(); }

int64_t Module::parameter_count() const {
  int64_t n = 0;
  for (const Tensor& p : parameters()) n += p.numel();
  return n;
}

OrderedDict<Tensor> Module::named_buffers() const {
  OrderedDict<Tensor> all;
  collect_buffers("", all);
  // As parameters: a buffer two modules share is one (broadcast, moved once),
  // under its first name.
  OrderedDict<Tensor> unique;
  std::unordered_set<const TensorImpl*> seen;
  for (const auto& [name, b] : all)
    if (seen.insert(b.impl_ptr().get()).second) unique.insert(name, b);
  return unique;
}

std::vector<std::pair<std::string, Module*>> Module::named_modules() {
  std::vector<std::pair<std::string, Module*>> out;
  collect_modules("", out);
  return out;
}

// ---- mode, placement, gradients --------------------------------------------------------------

void Module::train(bool on) {
  training_ = on;
  for (auto& [name, child] : children_) child->train(on);
}

void Module::to(const Device& device) {
  check_device_available(device);
  for (auto& [name, p] : named_parameters()) {
    move_in_place(p, device);
    if (Tensor g = p.grad(); g.defined()) p.set_grad(prim::to(g, device));
  }
  for (const auto& [name, b] : named_buffers()) move_in_place(b, device);
}

void Module::zero_grad() {
  for (auto& [name, p] : named_parameters()) p.set_grad(Tensor());
}

// ---- checkpoints -------------------------------------------------------------------------------

StateDict Module::state_dict() const {
  StateDict out;
  collect_state("", out);
  return out;
}

LoadResult Module::load_state_dict(const StateDict& dict, bool strict) {
  const StateDict own = state_dict();
  LoadResult result;
  std::vector<std::string> problems;
  bool key_problem = false, shape_problem = false, dtype_problem = false;

  for (const auto& [name, dst] : own) {
    const Tensor* src = dict.find(name);
    if (src == nullptr) {
      result.missing_keys.push_back(name);
      if (strict) {
        problems.push_back(fmt::format("missing key '{}' (the module has {})", name, describe(dst)));
        key_problem = true;
      }
      continue;
    }
    if (!src->defined()) {
      problems.push_back(fmt::format("key '{}' holds an undefined tensor (the module has {})", name, describe(dst)));
      key_problem = true;
    } else if (src->shape() != dst.shape()) {
      problems.push_back(fmt::format("shape mismatch for '{}': checkpoint {}, module {}", name, describe(*src),
                                     describe(dst)));
      shape_problem = true;
    } else if (src->dtype() != dst.dtype()) {
      problems.push_back(fmt::format("dtype mismatch for '{}': checkpoint {}, module {}", name, describe(*src),
                                     describe(dst)));
      dtype_problem = true;
    }
  }
  for (const auto& [name, src] : dict) {
    if (own.contains(name)) continue;
    result.unexpected_keys.push_back(name);
    if (strict) {
      problems.push_back(fmt::format("unexpected key '{}' ({})", name, describe(src)));
      key_problem = true;
    }
  }

  if (!problems.empty()) {
    std::string msg = fmt::format("{}.load_state_dict: {} problem{}, nothing was loaded:", type_name_,
                                  problems.size(), problems.size() == 1 ? "" : "s");
    for (const std::string& p : problems) msg += "\n  " + p;
    if (shape_problem && !key_problem && !dtype_problem) throw ShapeError(msg);
    if (dtype_problem && !key_problem && !shape_problem) throw DTypeError(msg);
    throw ValueError(msg);
  }

  NoGradGuard no_grad;  // a load is not part of any graph
  for (const auto& [name, dst] : own) {
    if (const Tensor* src = dict.find(name)) prim::copy_(dst, *src);
  }
  return result;
}

}  // namespace mpt::nn
