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
  // Sums two gradients of one slot with `add`: on the side stream when both
  // were made there (the sum counts as made there), on the current stream
  // after a join when one was, as it is when neither was.
  void sum_into(const Tensor& slot, const Tensor& g, const std::function<void()>& add);

  std::vector<Tensor> run(const Device& device, std::vector<Tensor> inputs,
                          const std::function<std::vector<Tensor>()>& work);
  void follow(const Device& device, std::vector<Tensor> inputs, const std::function<void()>& work);
  void written_here(const Tensor& t);

 private:
  struct Piece {
    std::unique_ptr<Event> side_before;  // the side stream before this piece
    std::vector<Tensor> inputs;          // chain tensors it reads
  };
  // Runs `work` on the side stream after everything queued so far on the
  // chain's. Every piece of side work starts so: the chain may have freed
  // memory that side work then gets (a block the chain read after a join,
  // say), and the chain's last use of it is then behind the side stream.
  void on_side(const std::function<void()>& work);
  void mark(const std::vector<Tensor>& made);
  bool made_beside(const Tensor& t) const;

  BesidePass* previous_;
  std::optional<Stream> chain_, side_;  // set by the first piece
  std::deque<Piece> in_flight_;  // empty: no side work since the last join
  // By address, with a weak reference that tells a tensor made beside from
  // a later one that happens to get its address.
  std::unordered_map<const TensorImpl*, std::weak_ptr<TensorImpl>> made_beside_;
};

}  // namespace mpt
