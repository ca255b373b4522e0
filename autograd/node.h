#pragma once
// The autograd graph. Each op that records history creates one Node whose
// backward rule maps the gradients of its outputs to the gradients of its
// inputs; edges lead to the nodes that produced those inputs, or to a leaf's
// AccumulateGrad sink.
#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tensor/stream.h"
#include "tensor/tensor.h"

namespace mpt {

struct Edge {
  std::shared_ptr<Node> node;  // null: the input needs no gradient
  uint32_t input_nr = 0;       // which output of `node` the input was
};

class Node {
 public:
  explicit Node(std::string name);
  virtual ~Node() = default;

  const std::string& name() const { return name_; }
  // Creation order: later nodes run first when several are ready, which
  // replays forward in reverse (and lets data parallelism see gradients in a
  // stable order). A leaf's sink ranks above every node (see AccumulateGrad).
  uint64_t sequence_nr() const { return sequence_nr_; }
  std::vector<Edge>& next_edges() { return next_; }
  uint32_t num_outputs() const { return num_outputs_; }
  void set_num_outputs(uint32_t n) { num_outputs_ = n; }

  // Gradients of the inputs, one per next edge (undefined where none flows).
  // `grads` has one entry per output; undefined ones mean zero.
  virtual std::vector<Tensor> apply(std::vector<Tensor>&& grads) = 0;
  // Drops what forward saved, after a backward without retain_graph.
  virtual void release() {}

  // Whether the rule may run on the pass's side stream once every gradient
  // it receives was made there (see beside.h): it reads nothing else and
  // calls no one else's code.
  virtual bool may_run_beside() const { return false; }

  // The CUDA stream forward ran on; the engine runs the backward rule there
  // too, so a model run on a side stream stays on it in both directions.
  const std::optional<Stream>& stream() const { return stream_; }
  void set_stream(const Stream& s) { stream_ = s; }

 protected:
  Node(std::string name, uint64_t sequence_nr) : name_(std::move(name)), sequence_nr_(sequence_nr) {}

 private:
  std::string name_;
  std::optional<Stream> stream_;
  uint64_t sequence_nr_;
  std::vector<Edge> next_;
  uint32_t num_outputs_ = 1;
};

// A node whose backward rule is a function (flashlight style: the rule is
// written beside the forward code, capturing what it needs).
class FunctionNode final : public Node {
 public:
  using Rule = std::function<std::vector<Tensor>(const std::vector<Tensor>& grads)>;
  // Whether the rule captured tensors. One that captured none has nothing to
  // free and may run in any number of backward passes: autocast's cached
  // weight cast is shared by every forward in its region (gradient
  // accumulation), as PyTorch's cast node is.
  enum class Saves { tensors, nothing };
  FunctionNode(std::string name, Rule rule, Saves saves = Saves::tensors)
      : Node(std::move(name)), rule_(std::move(rule)), saves_(saves) {}
  std::vector<Tensor> apply(std::vector<Tensor>&& grads) override;
  bool may_run_beside() const override { return saves_ == Saves::nothing; }
  void release() override {
    if (saves_ == Saves::tensors) {
      rule_ = nullptr;
      saved_.clear();
    }
  }

  // A tensor the rule reads, as forward left it: its storage and that
  // storage's version (tensor/storage.h). If either differs when the rule
  // is about to run, the tensor was written in place (or moved) after
  // forward, and the gradient would be computed from other values: apply()
  // refuses, naming the node and the tensor, as PyTorch does.
  // Which of the node's tensors a saved one is, for the message (worked
  // out into text only when there is one to write).
  struct SavedRole {
    const char* kind;  // "input", "output", or "saved tensor" (no index)
    int index = -1;
  };
  struct SavedVersion {
    std::shared_ptr<TensorImpl> tensor;
    std::shared_ptr<Storage> storage;
    uint64_t version;
    SavedRole role;
  };
  void note_saved(const Tensor& t, SavedRole role);

 private:
  void check_saved_unchanged() const;

  Rule rule_;
  Saves saves_;
  std::vector<SavedVersion> saved_;
};

// The sink for a leaf: adds the incoming gradient to leaf.grad and then
// runs the leaf's post-accumulate hooks.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(std::shared_ptr<TensorImpl> leaf);
  std::vector<Tensor> apply(std::vector<Tensor>&& grads) override;
  bool may_run_beside() const override;  // without hooks other than stream-ordered ones

 private:
  std::shared_ptr<TensorImpl> leaf_;
};

// The edge through which a gradient reaches `t` (its grad_fn, or its
// leaf's AccumulateGrad, created on demand); null if t needs no gradient.
Edge gradient_edge(const Tensor& t);

}  // namespace mpt
