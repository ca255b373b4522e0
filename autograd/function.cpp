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

void record(const char* name, std::vector<Tensor>& outs, const std::vector<Tensor>& inputs, FunctionNode::Rule rule,
            FunctionNode::Saves saves) {
  auto node = std::make_shared<FunctionNode>(name, std::move(rule), saves);
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

void record(const char* name, Tensor& out, const std::vector<Tensor>& inputs, FunctionNode::Rule rule,
            FunctionNode::Saves saves) {
  std::vector<Tensor> outs{out};
  record(name, outs, inputs, std::move(rule), saves);
  out = outs[0];
}

}  // namespace mpt
