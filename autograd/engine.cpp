// The backward engine: counts each node's consumers, then runs nodes whose
// gradients are complete, latest-created first, summing the gradients that
// reach each node's outputs.
#include "autograd/engine.h"

#include <optional>
#include <queue>
#include <utility>
#include <unordered_map>

#include "autograd/beside_pass.h"
#include "autograd/grad_mode.h"
#include "autograd/node.h"
#include "tensor/device_guard.h"
#include "tensor/ops.h"
#include "tensor/stream.h"

namespace mpt {
namespace {

struct NodeState {
  int pending = 0;             // consumers whose gradients have not arrived yet
  std::vector<Tensor> grads;   // one slot per output of the node
};

// Adds g into slot; `from` names the rule that made g (and which of its
// inputs it is for) in the error a rule returning a wrong shape causes.
template <typename From>
void accumulate(Tensor& slot, const Tensor& g, const From& from) {
  if (!g.defined()) return;
  if (!slot.defined()) {
    slot = g;
  } else if (slot.shape() == g.shape() && slot.dtype() == g.dtype()) {
    slot = prim::add(slot, g);
  } else {
    throw ShapeError(fmt::format("backward: {} made the gradient {}, but another gradient of the same tensor is {}",
                                 from(), describe(g), describe(slot)));
  }
}

}  // namespace

namespace {
thread_local BackwardObserver t_observer;
}  // namespace

void set_backward_observer(BackwardObserver observer) { t_observer = std::move(observer); }

void backward(const Tensor& root, const Tensor& grad, bool retain_graph) {
  backward(std::vector<Tensor>{root}, std::vector<Tensor>{grad}, retain_graph);
}

void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads_in, bool retain_graph) {
  check(roots.size() == grads_in.size(), "backward: {} roots but {} gradients", roots.size(), grads_in.size());
  // Gradients of the roots.
  std::vector<std::pair<Edge, Tensor>> seeds;
  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& r = roots[i];
    check(r.requires_grad(),
          "backward: the tensor {} does not require grad and has no grad_fn (is every parameter "
          "requires_grad, and was grad mode on?)",
          describe(r));
    Tensor g = grads_in[i];
    if (!g.defined()) {
      check<ShapeError>(r.numel() == 1, "backward: the root {} is not a scalar; pass its gradient", describe(r));
      g = full(r.shape(), 1.0, r.dtype(), r.device());
    }
    check<ShapeError>(g.shape() == r.shape(), "backward: gradient {} does not match the root {}", describe(g),
                      describe(r));
    check<DeviceError>(g.device() == r.device(), "backward: gradient {} and root {} are on different devices",
                       describe(g), describe(r));
    check<DTypeError>(is_floating(g.dtype()), "backward: gradient {} is not floating", describe(g));
    // Another float dtype is converted, as PyTorch converts it.
    if (g.dtype() != r.dtype()) g = prim::to(g, r.dtype());
    seeds.emplace_back(gradient_edge(r), g);
  }

  // Count, for each node reachable from the roots, how many edges lead to it.
  std::unordered_map<Node*, NodeState> state;
  std::vector<Node*> stack;
  for (auto& [edge, g] : seeds) {
    if (state.emplace(edge.node.get(), NodeState{}).second) stack.push_back(edge.node.get());
  }
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (Edge& e : n->next_edges()) {
      if (!e.node) continue;
      auto [it, inserted] = state.emplace(e.node.get(), NodeState{});
      ++it->second.pending;
      if (inserted) stack.push_back(e.node.get());
    }
  }
  for (auto& [node, st] : state) st.grads.resize(node->num_outputs());
  for (auto& [edge, g] : seeds)
    accumulate(state[edge.node.get()].grads[edge.input_nr], g, [] { return std::string("a root's gradient"); });

  auto later_first = [](Node* a, Node* b) { return a->sequence_nr() < b->sequence_nr(); };
  std::priority_queue<Node*, std::vector<Node*>, decltype(later_first)> ready(later_first);
  for (auto& [node, st] : state)
    if (st.pending == 0) ready.push(node);

  // Each rule runs on its forward stream; nodes without one (leaf sinks)
  // run on the caller's current stream. Where consecutive nodes change
  // stream, the next waits for the previous, so gradients handed from one
  // to the other are complete; the caller's stream waits for the last.
  // (The streams stay joined this way, so a gradient freed after its rule
  // is never reused on its own stream while another still reads it.)
  std::optional<Stream> previous;
  auto enter = [&previous](const Stream& next) {
    if (previous && !(*previous == next)) {
      Event handed_over(previous->device());
      handed_over.record(*previous);
      handed_over.wait(next);
    }
    previous = next;
  };
  // The roots' gradients were made (by the caller, or above) on the caller's
  // streams: the first rule waits for them when it runs on another stream.
  for (const Tensor& r : roots)
    if (r.device().is_cuda()) enter(current_stream(r.device()));

  // Backward ops record no history of their own.
  NoGradGuard no_grad;
  BesidePass beside;
  while (!ready.empty()) {
    Node* node = ready.top();
    ready.pop();
    NodeState& st = state[node];
    // A rule whose gradients were all made on the side stream, and that
    // reads nothing else, stays there; any other rule that receives one
    // waits for the side stream first (see beside.h).
    const bool stays_beside = node->may_run_beside() && beside.all_made_beside(st.grads);
    if (!stays_beside && beside.any_made_beside(st.grads))
      beside.join(node->stream() ? *node->stream() : current_stream(previous ? previous->device() : kCPU));
    std::optional<StreamGuard> on_forward_stream;
    if (node->stream()) {
      enter(*node->stream());
      on_forward_stream.emplace(*node->stream());
    } else if (previous) {
      enter(current_stream(previous->device()));
    }
    // The incoming gradients are taken out of the node's state (and freed
    // when the rule is done with them), not left there until the pass ends.
    std::vector<Tensor> in_grads = stays_beside ? beside.apply_beside(*node, std::exchange(st.grads, {}))
                                                : node->apply(std::exchange(st.grads, {}));
    if (!retain_graph) node->release();
    auto& edges = node->next_edges();
    check(in_grads.size() == edges.size() || edges.empty(),
          "backward: '{}' returned {} gradients for {} inputs", node->name(), in_grads.size(), edges.size());
    for (size_t i = 0; i < edges.size(); ++i) {
      const Edge& e = edges[i];
      if (!e.node) continue;
      NodeState& next = state[e.node.get()];
      Tensor& slot = next.grads[e.input_nr];
      beside.sum_into(slot, in_grads[i], [&] {
        accumulate(slot, in_grads[i],
                   [&] { return fmt::format("the rule of '{}' (for its input {})", node->name(), i); });
      });
      if (--next.pending == 0) ready.push(e.node.get());
    }
    if (t_observer) {
      in_grads.clear();
      t_observer(node->name());
    }
  }
  if (previous) {
    beside.join(current_stream(previous->device()));
    enter(current_stream(previous->device()));
  }
}

}  // namespace mpt
