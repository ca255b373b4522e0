#include "autograd/function.h"

#include "autograd/grad_mode.h"

namespace mpt {

bool needs_grad(std::initializer_list<Tensor> inputs) {
  if (!grad_enabled()) return false;
  for (const Tensor& t : inputs)
    if (t.requires_grad()) return true;
  return false;
}

bool needs_grad(const std::vector<Tensor>& inputs) {
  if (!grad_enabled()) return false;
  for (const Tensor& t : inputs)
    if (t.requires_grad()) return true;
  return false;
}

namespace {

// Makes each of `outs` an output of `node`, whose edges lead to `inputs`.
void attach(const std::shared_ptr<FunctionNode>& node, std::vector<Tensor>& outs, const std::vector<Tensor>& inputs) {
  node->set_num_outputs(static_cast<uint32_t>(outs.size()));
  if (!outs.empty() && outs[0].defined() && outs[0].device().is_cuda())
    node->set_stream(current_stream(outs[0].device()));
  for (const Tensor& t : inputs) node->next_edges().push_back(gradient_edge(t));
  for (size_t i = 0; i < outs.size(); ++i) {
    // A fresh handle with its own autograd slot: a raw op may have returned
    // one of its inputs (or a view sharing its storage) as the result.
    auto impl = std::make_shared<TensorImpl>(outs[i].impl());
    impl->autograd = std::make_shared<AutogradMeta>();
    outs[i] = Tensor(std::move(impl));
    AutogradMeta& meta = outs[i].autograd_meta();
    meta.requires_grad = true;
    meta.grad_fn = node;
    meta.output_nr = static_cast<uint32_t>(i);
  }
}

// How a message names a saved tensor: the input or output it is, if any.
FunctionNode::SavedRole role_of(const Tensor& t, const std::vector<Tensor>& inputs, const std::vector<Tensor>& outs) {
  const auto same_view = [&](const Tensor& o) {
    return o.defined() && o.storage() == t.storage() && o.offset() == t.offset() && o.shape() == t.shape() &&
           o.strides() == t.strides() && o.dtype() == t.dtype();
  };
  for (size_t i = 0; i < inputs.size(); ++i)
    if (same_view(inputs[i])) return {"input", static_cast<int>(i)};
  for (size_t i = 0; i < outs.size(); ++i)
    if (same_view(outs[i])) return {"output", static_cast<int>(i)};
  return {"saved tensor"};
}

}  // namespace

void record(const char* name, std::vector<Tensor>& outs, const std::vector<Tensor>& inputs, FunctionNode::Rule rule,
            FunctionNode::Saves saves) {
  attach(std::make_shared<FunctionNode>(name, std::move(rule), saves), outs, inputs);
}

void record(const char* name, Tensor& out, const std::vector<Tensor>& inputs, FunctionNode::Rule rule,
            FunctionNode::Saves saves) {
  std::vector<Tensor> outs{out};
  record(name, outs, inputs, std::move(rule), saves);
  out = outs[0];
}

void record(const char* name, std::vector<Tensor>& outs, const std::vector<Tensor>& inputs, const Saved& saved,
            FunctionNode::Rule rule) {
  auto node = std::make_shared<FunctionNode>(name, std::move(rule));
  // Noted before attach() gives the outputs their own handles, while they
  // are still the views the op computed.
  for (const Tensor& t : saved.tensors)
    if (t.defined()) node->note_saved(t, role_of(t, inputs, outs));  // an absent weight or bias: nothing to check
  attach(node, outs, inputs);
}

void record(const char* name, Tensor& out, const std::vector<Tensor>& inputs, const Saved& saved,
            FunctionNode::Rule rule) {
  std::vector<Tensor> outs{out};
  record(name, outs, inputs, saved, std::move(rule));
  out = outs[0];
}

}  // namespace mpt
