#pragma once
// Module: the unit models are built from. It owns named parameters (f32
// master weights that require gradients), named buffers (state that is
// saved but not trained) and named submodules, and walks them recursively
// in registration order, giving dotted names such as
// "blocks.0.attn.qkv.weight" exactly as PyTorch does, so checkpoints and
// traces line up with the reference.
//
// A layer keeps plain Tensor members for its parameters (weight, bias) and
// registers the same handles here. Everything that changes a parameter
// afterwards (to(), load_state_dict()) does so in place, on the shared
// TensorImpl, so those members, an optimizer's handles and any gradient
// hooks stay valid.
#include <memory>
#include <string>
#include <vector>

#include "models/ordered_dict.h"
#include "tensor/tensor.h"

namespace mpt::nn {

using StateDict = OrderedDict<Tensor>;

// What load_state_dict(..., strict=false) skipped.
struct LoadResult {
  std::vector<std::string> missing_keys;     // in the module, not in the dict
  std::vector<std::string> unexpected_keys;  // in the dict, not in the module
};

class Module {
 public:
  explicit Module(std::string type_name) : type_name_(std::move(type_name)) {}
  virtual ~Module() = default;
  // Copying would alias the parameters of two "different" modules.
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // "Linear", "Sequential", ...: for messages.
  const std::string& type_name() const { return type_name_; }

  // The computation of a single-input module. Modules with several inputs
  // define their own signature; this default throws.
  virtual Tensor forward(const Tensor& x);
  Tensor operator()(const Tensor& x) { return forward(x); }

  // ---- walking the tree -------------------------------------------------------
  // All parameters, this module's first, then each child's (prefixed with
  // the child's name), in registration order. Also stamps each parameter's
  // AutogradMeta::name with its dotted name, so autograd and optimizer
  // messages can say which parameter they mean.
  OrderedDict<Tensor> named_parameters() const;
  std::vector<Tensor> parameters() const;
  // The elements of all parameters (a shared one counted once), as
  // PyTorch's sum(p.numel() for p in model.parameters()).
  int64_t parameter_count() const;
  OrderedDict<Tensor> named_buffers() const;
  // Direct children only.
  const OrderedDict<std::shared_ptr<Module>>& named_children() const { return children_; }
  // Every module in the tree, this one first (named ""), depth first.
  std::vector<std::pair<std::string, Module*>> named_modules();

  // ---- mode, placement, gradients -------------------------------------------------
  // Training mode (dropout active) for this module and all below it.
  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }

  // Moves every parameter (with its gradient) and buffer to `device`, in
  // place: existing Tensor handles see the new device. Create optimizers
  // after this anyway; an optimizer's state made before the move would stay
  // behind on the old device.
  void to(const Device& device);

  // Drops every parameter's gradient (undefined, not zero-filled: the next
  // backward writes it fresh instead of adding to zeros).
  void zero_grad();

  // ---- checkpoints ----------------------------------------------------------------------
  // By dotted name, in PyTorch's order: a module's own parameters, then its
  // own buffers, then each child's in registration order. The tensors are
  // the live ones (not copies): clone them to keep a snapshot.
  StateDict state_dict() const;
  // Copies values in place. Everything is checked before anything is
  // written, so a failed load leaves the module untouched. Errors list every
  // offending key with both shapes/dtypes: missing or unexpected keys (only
  // with strict), shape or dtype mismatches (always). The thrown type is
  // ShapeError or DTypeError when those are the only problems, else
  // ValueError. The source may live on any device.
  LoadResult load_state_dict(const StateDict& dict, bool strict = true);

 protected:
  // Registers a parameter: stored as f32 (a floating tensor of another
  // dtype is converted), marked requires_grad. Returns the registered handle.
  Tensor register_parameter(const std::string& name, Tensor value);
  Tensor register_buffer(const std::string& name, Tensor value);
  template <typename M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> module) {
    check_new_name(name, "submodule");
    check(module != nullptr, "{}: register_module('{}') got a null module", type_name_, name);
    children_.insert(name, module);
    return module;
  }

  const OrderedDict<Tensor>& own_parameters() const { return params_; }

 private:
  void check_new_name(const std::string& name, const char* what) const;
  void collect_parameters(const std::string& prefix, OrderedDict<Tensor>& out) const;
  void collect_buffers(const std::string& prefix, OrderedDict<Tensor>& out) const;
  void collect_state(const std::string& prefix, OrderedDict<Tensor>& out) const;
  void collect_modules(const std::string& prefix, std::vector<std::pair<std::string, Module*>>& out);

  std::string type_name_;
  OrderedDict<Tensor> params_;
  OrderedDict<Tensor> buffers_;
  OrderedDict<std::shared_ptr<Module>> children_;
  bool training_ = true;
};

}  // namespace mpt::nn
