#pragma once
// The backward engine's record of one pass's side stream (see beside.h):
// which gradients were made beside, which chain tensors side work still
// reads, and the waits that order the two streams.
#include <deque>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "autograd/beside.h"
#include "tensor/stream.h"

namespace mpt {

class Node;

class BesidePass {
 public:
  // Serves beside::run on this thread until destroyed (when beside is enabled).
  BesidePass();
  // Joins whatever is still in flight (a pass that ended in an error).
  ~BesidePass();
  BesidePass(const BesidePass&) = delete;
  BesidePass& operator=(const BesidePass&) = delete;

  // Whether any / every defined gradient of `grads` was made beside.
  bool any_made_beside(const std::vector<Tensor>& grads) const;
  bool all_made_beside(const std::vector<Tensor>& grads) const;
  // Runs `node`'s rule on the side stream; its results count as made beside.
  std::vector<Tensor> apply_beside(Node& node, std::vector<Tensor>&& grads);
  // `stream` (and the pass's own stream) wait for all side work so far.
  void join(const Stream& stream);

  std::vector<Tensor> run(const Device& device, std::vector<Tensor> inputs,
                          const std::function<std::vector<Tensor>()>& work);
  void follow(const Device& device, std::vector<Tensor> inputs, const std::function<void()>& work);

 private:
  struct Piece {
    std::unique_ptr<Event> side_before;  // the side stream before this piece
    std::vector<Tensor> inputs;          // chain tensors it reads
  };
  void mark(const std::vector<Tensor>& made);
  bool made_beside(const Tensor& t) const;

  BesidePass* previous_;
  std::optional<Stream> chain_, side_;  // set by the first piece
  std::deque<Piece> in_flight_;
  // By address, with a weak reference that tells a tensor made beside from
  // a later one that happens to get its address.
  std::unordered_map<const TensorImpl*, std::weak_ptr<TensorImpl>> made_beside_;
  bool side_has_work_ = false;
};

}  // namespace mpt
