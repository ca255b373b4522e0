#pragma once
// How an op records itself: compute the result with raw tensor ops, then,
// if any input needs a gradient, attach the backward rule.
//
//   Tensor out = prim::mul(a, b);
//   if (needs_grad({a, b}))
//     record("mul", out, {a, b}, [a, b](const Grads& g) { return Grads{g[0] * b, g[0] * a}; });
#include <initializer_list>
#include <vector>

#include "autograd/node.h"

namespace mpt {

using Grads = std::vector<Tensor>;

// True when grad mode is on and some input requires a gradient.
bool needs_grad(std::initializer_list<Tensor> inputs);
bool needs_grad(const std::vector<Tensor>& inputs);

// Makes `out` (or each of `outs`) the output of a new node with `rule`.
// The rule receives one gradient per output (undefined = zero) and returns
// one per input, in order (undefined where an input gets none).
// `saves` says whether the rule captured tensors (see FunctionNode).
void record(const char* name, Tensor& out, const std::vector<Tensor>& inputs, FunctionNode::Rule rule,
            FunctionNode::Saves saves = FunctionNode::Saves::tensors);
void record(const char* name, std::vector<Tensor>& outs, const std::vector<Tensor>& inputs, FunctionNode::Rule rule,
            FunctionNode::Saves saves = FunctionNode::Saves::tensors);

// The same, for a rule that reads the values of `saved` (inputs, outputs,
// or other tensors its caller may still hold, such as a target). Their
// versions are noted now, and backward refuses to run the rule if one was
// written in place since (see FunctionNode::SavedVersion). Tensors the op
// made for itself alone need not be listed: nobody else can write them.
//
//   record("mul", out, {a, b}, Saved{a, b}, [a, b](const Grads& g) { ... });
struct Saved {
  Saved(std::initializer_list<Tensor> tensors) : tensors(tensors) {}
  std::vector<Tensor> tensors;
};
void record(const char* name, Tensor& out, const std::vector<Tensor>& inputs, const Saved& saved,
            FunctionNode::Rule rule);
void record(const char* name, std::vector<Tensor>& outs, const std::vector<Tensor>& inputs, const Saved& saved,
            FunctionNode::Rule rule);

}  // namespace mpt
