#include "autograd/node.h"

#include <limits>
#include <string>

#include <fmt/format.h>

#include "autograd/beside.h"
#include "tensor/ops.h"

namespace mpt {
namespace {
std::atomic<uint64_t> g_next_sequence_nr{0};
}

Node::Node(std::string name) : name_(std::move(name)), sequence_nr_(g_next_sequence_nr++) {}

std::vector<Tensor> FunctionNode::apply(std::vector<Tensor>&& grads) {
  check(static_cast<bool>(rule_),
        "backward through '{}' a second time: its saved tensors were already freed (call backward with "
        "retain_graph = true the first time)",
        name());
  check_saved_unchanged();
  return rule_(grads);
}

void FunctionNode::note_saved(const Tensor& t, SavedRole role) {
  saved_.push_back(SavedVersion{t.impl_ptr(), t.storage(), t.version(), role});
}

// Runs before every rule: the messages are formatted only for a tensor
// that fails, not for every saved tensor of every pass.
void FunctionNode::check_saved_unchanged() const {
  for (const SavedVersion& s : saved_) {
    const Tensor now(s.tensor);
    const bool moved = now.storage() != s.storage;
    if (!moved && s.storage->version() == s.version) continue;
    const std::string role =
        s.role.index >= 0 ? fmt::format("{} {}", s.role.kind, s.role.index) : std::string(s.role.kind);
    if (moved)
      throw Error(fmt::format("backward through '{}': its {} ({}) was moved to other memory after the forward pass "
                              "(a module's to(), say), so the values its gradient needs are gone; move before the "
                              "forward pass",
                              name(), role, describe(now)));
    throw Error(fmt::format("backward through '{}': its {} ({}), which this gradient needs, was written in place "
                            "after the forward pass (version {} then, {} now); write to a copy (prim::clone), or "
                            "after backward",
                            name(), role, describe(now), s.version, s.storage->version()));
  }
}

// A sink runs as soon as its gradient is complete, whatever its creation
// order: it lives as long as anything holds the leaf's graph (the last
// step's loss keeps it, so the sinks made in the first step serve every
// later one), and with its creation number it would run after every other
// node of the pass, so DDP's hooks would fire only once backward ended and
// no all-reduce would overlap it. (PyTorch ranks its sinks the same way.)
AccumulateGrad::AccumulateGrad(std::shared_ptr<TensorImpl> leaf)
    : Node("AccumulateGrad", std::numeric_limits<uint64_t>::max()), leaf_(std::move(leaf)) {
  set_num_outputs(1);
}

std::vector<Tensor> AccumulateGrad::apply(std::vector<Tensor>&& grads) {
  Tensor leaf(leaf_);
  Tensor g = std::move(grads.at(0));
  if (!g.defined()) return {};
  AutogradMeta& meta = leaf.autograd_meta();
  if (g.shape() != leaf.shape())  // (the message made only for a failure: this runs for every leaf)
    throw ShapeError(fmt::format("backward: gradient {} does not match its leaf {}{}", describe(g), describe(leaf),
                                 meta.name.empty() ? "" : fmt::format(" ('{}')", meta.name)));
  // The gradient takes the leaf's dtype (f32 master weights get f32 grads).
  if (g.dtype() != leaf.dtype()) g = prim::to(g, leaf.dtype());
  if (!meta.grad.defined()) {
    // Later accumulation adds into the gradient in place, so it must be
    // ours alone. The incoming tensor usually is (a rule's fresh result, or
    // the cast above): then it is taken as it is; one that anything else
    // still sees (another edge, a saved tensor, a view) is copied.
    const bool ours_alone = g.impl_ptr().use_count() == 1 && g.storage().use_count() == 1 &&
                            !g.impl().autograd && g.is_contiguous();
    meta.grad = ours_alone ? std::move(g) : prim::contiguous(g).is_same(g) ? prim::clone(g) : prim::contiguous(g);
  } else {
    prim::binary_(BinaryOp::add, meta.grad, meta.grad, g);
  }
  // Running beside the chain (backward's side stream), the gradient is
  // complete only there: a hook on the chain that reads it must wait.
  beside::written_here(meta.grad);
  for (auto& hook : meta.post_accumulate_hooks) hook(leaf);
  for (auto& hook : meta.stream_ordered_post_accumulate_hooks) hook(leaf);
  return {};
}

bool AccumulateGrad::may_run_beside() const {
  return !leaf_->autograd || leaf_->autograd->post_accumulate_hooks.empty();
}

Edge gradient_edge(const Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return {};
  AutogradMeta& meta = t.autograd_meta();
  if (meta.grad_fn) return {meta.grad_fn, meta.output_nr};
  std::shared_ptr<Node> acc = meta.grad_accumulator.lock();
  if (!acc) {
    acc = std::make_shared<AccumulateGrad>(t.impl_ptr());
    meta.grad_accumulator = acc;
  }
  return {acc, 0};
}

}  // namespace mpt
