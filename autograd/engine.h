#pragma once
// Reverse-mode differentiation over the recorded graph.
#include <functional>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace mpt {

// Accumulates d(root)/d(leaf) into every leaf's .grad that the root depends
// on. A scalar root needs no `grad` (1 is used); otherwise pass the
// gradient of the root. Without retain_graph the graph's saved tensors are
// freed as it runs, and a second backward through it is an error.
void backward(const Tensor& root, const Tensor& grad = Tensor(), bool retain_graph = false);
void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads, bool retain_graph = false);

// Called by backward() on this thread after each node's rule has run and
// its saved tensors were released, with the node's name (e.g. to trace
// memory through a backward pass). Empty: none (the default).
using BackwardObserver = std::function<void(const std::string& node_name)>;
void set_backward_observer(BackwardObserver observer);

}  // namespace mpt
