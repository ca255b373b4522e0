#include "autograd/beside.h"

#include <atomic>

#include "autograd/beside_pass.h"
#include "autograd/node.h"
#include "tensor/stream_per_device.h"

namespace mpt {
namespace {

std::atomic<bool> g_enabled{true};
thread_local BesidePass* t_pass = nullptr;

// One side stream per device for each thread that runs backward passes.
// Shared by two threads, it would hand one thread's freed side-made
// gradients to the other's side work, which waits only for its own
// thread's stream, not for the optimizer that may still read them.
Stream side_stream(const Device& device) {
  thread_local StreamPerDevice streams;
  return streams.get(device);
}

}  // namespace

namespace beside {

bool enabled() { return g_enabled.load(std::memory_order_relaxed); }
void set_enabled(bool on) { g_enabled.store(on, std::memory_order_relaxed); }

std::vector<Tensor> run(const Device& device, std::vector<Tensor> inputs,
                        const std::function<std::vector<Tensor>()>& work) {
  if (!t_pass || !device.is_cuda()) return work();
  return t_pass->run(device, std::move(inputs), work);
}

void follow(const Device& device, std::vector<Tensor> inputs, const std::function<void()>& work) {
  if (!t_pass || !device.is_cuda()) return work();
  t_pass->follow(device, std::move(inputs), work);
}

void written_here(const Tensor& t) {
  if (t_pass && t.defined() && t.device().is_cuda()) t_pass->written_here(t);
}

}  // namespace beside

BesidePass::BesidePass() : previous_(t_pass) {
  if (beside::enabled()) t_pass = this;
}

BesidePass::~BesidePass() {
  if (t_pass == this) t_pass = previous_;
  try {
    if (chain_) join(*chain_);
  } catch (...) {
    // A destructor must not throw; the CUDA error resurfaces at the next call.
  }
}

bool BesidePass::made_beside(const Tensor& t) const {
  if (!t.defined()) return false;
  const auto it = made_beside_.find(t.impl_ptr().get());
  // While the tensor made beside lives, no other can have its address.
  return it != made_beside_.end() && !it->second.expired();
}

bool BesidePass::any_made_beside(const std::vector<Tensor>& grads) const {
  if (made_beside_.empty()) return false;
  for (const Tensor& g : grads)
    if (made_beside(g)) return true;
  return false;
}

bool BesidePass::all_made_beside(const std::vector<Tensor>& grads) const {
  bool any = false;
  for (const Tensor& g : grads) {
    if (!g.defined()) continue;
    if (!made_beside(g)) return false;
    any = true;
  }
  return any;
}

void BesidePass::mark(const std::vector<Tensor>& made) {
  for (const Tensor& t : made)
    if (t.defined()) made_beside_[t.impl_ptr().get()] = t.impl_ptr();
}

void BesidePass::on_side(const std::function<void()>& work) {
  Event chain_now(side_->device());
  chain_now.record(*chain_);
  chain_now.wait(*side_);
  StreamGuard side(*side_);
  work();
}

std::vector<Tensor> BesidePass::apply_beside(Node& node, std::vector<Tensor>&& grads) {
  std::vector<Tensor> made;
  on_side([&] { made = node.apply(std::move(grads)); });
  mark(made);
  return made;
}

void BesidePass::join(const Stream& stream) {
  if (in_flight_.empty()) return;  // no side work since the last join
  Event done(side_->device());
  done.record(*side_);
  done.wait(*chain_);
  if (stream.device().is_cuda() && !(stream == *chain_)) done.wait(stream);
  in_flight_.clear();  // the chain's stream is past every read of them
  made_beside_.clear();
}

void BesidePass::sum_into(const Tensor& slot, const Tensor& g, const std::function<void()>& add) {
  const bool slot_beside = made_beside(slot), g_beside = made_beside(g);
  if (!slot.defined() || !g.defined() || (!slot_beside && !g_beside)) return add();
  if (!slot_beside || !g_beside) {
    join(current_stream(side_->device()));
    return add();
  }
  on_side(add);
  mark({slot});
}

std::vector<Tensor> BesidePass::run(const Device& device, std::vector<Tensor> inputs,
                                    const std::function<std::vector<Tensor>()>& work) {
  const Stream current = current_stream(device);
  if (!chain_) {
    chain_ = current;
    side_ = side_stream(device);
  }
  // Another device or stream than the pass's: not worth the bookkeeping,
  // run in order. (On the side stream itself, from a rule or hook that runs
  // beside, the piece still waits for the chain: it may read its tensors.)
  if (!(current == *chain_) && !(current == *side_)) return work();

  Piece piece{std::make_unique<Event>(device), std::move(inputs)};
  piece.side_before->record(*side_);
  std::vector<Tensor> made;
  on_side([&] { made = work(); });
  mark(made);
  // The chain catches up with the side stream as it was before the previous
  // piece: the pieces before that are done for it, and their inputs free.
  in_flight_.push_back(std::move(piece));
  if (in_flight_.size() > 2) {
    in_flight_[1].side_before->wait(*chain_);
    in_flight_.pop_front();
  }
  return made;
}

void BesidePass::follow(const Device& device, std::vector<Tensor> inputs, const std::function<void()>& work) {
  const Stream current = current_stream(device);
  const bool on_chain = !chain_ || current == *chain_;
  if (on_chain && !any_made_beside(inputs)) return work();
  // On a third stream (a sink on the caller's stream, forward having run on
  // another): run() would run the work there as it is; it must wait for
  // the side stream first.
  if (!on_chain && !(current == *side_)) {
    if (any_made_beside(inputs)) join(current);
    return work();
  }
  run(device, std::move(inputs), [&] {
    work();
    return std::vector<Tensor>{};
  });
}

void BesidePass::written_here(const Tensor& t) {
  if (side_ && current_stream(side_->device()) == *side_) mark({t});
}

}  // namespace mpt
