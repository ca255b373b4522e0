#pragma once
// DistributedDataParallel: one replica of the model per process, gradients
// averaged over the ranks during backward.
//
// At construction rank 0's parameters and buffers are broadcast, after
// checking that every rank has the same parameter names and shapes; the
// buffers again before each synchronised forward (DdpOptions). Each
// parameter gets a post-accumulate hook (autograd calls it once the
// parameter's gradient of this backward is complete); when every gradient
// of a bucket is ready the bucket is all-reduced on the process group's
// communication thread (or stream) while backward goes on. The last hook of
// the backward waits for the buckets, so when backward() returns the
// gradients are synchronised. The averaged gradients are views into the
// buckets (PyTorch's gradient_as_bucket_view; copies when they travel
// compressed): a gradient kept past the next synchronised backward is
// overwritten by it, so clone one to keep it.
//
// Buckets start in reverse registration order (the order backward usually
// produces gradients) and are rebuilt once, before the second synchronised
// iteration, in the order rank 0 observed them becoming ready.
//
// With overlap_step_with(scaler), backward returns without waiting for the
// last bucket, whose all-reduce then overlaps the optimizer step the scaler
// takes (the bucket of the first layers' gradients, which backward produces
// last: nothing else can hide it).
//
// Gradient accumulation: inside no_sync(), backward only accumulates
// locally; the first synchronised backward after it all-reduces the sums.
// With a loss scaler, unscale once per accumulation window, after that
// synchronised backward, and agree on overflow with allreduce_found_inf().
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "amp/grad_scaler.h"
#include "models/module.h"
#include "parallel/bucket.h"
#include "parallel/process_group.h"

namespace mpt::dist {

struct DdpOptions {
  // Cap of the bucket that starts first; 0: bucket_bytes. PyTorch makes it
  // 1 MiB so that communication starts early; in a step replayed as a CUDA
  // graph that all-reduce starts while the ranks are still out of step, and
  // its kernel waits for the late rank on SMs that backward needs.
  size_t first_bucket_bytes = 0;
  size_t bucket_bytes = size_t(25) << 20;  // 25 MiB
  // Find, at each forward, the parameters the output does not depend on and
  // count them as ready (their gradient contributes zero). Without it, such
  // a parameter makes the next forward() fail, naming it.
  bool find_unused_parameters = false;
  // Gradients travel as f16 or bf16 (halving traffic) and come back to f32.
  std::optional<DType> compression;
  // Bucket buffers in memory the group registers for its collectives
  // (ProcessGroup::registered_buffer; NCCL: a symmetric window, whose
  // all-reduces have less latency). Off by default: NCCL's symmetric kernels do not
  // end when a communicator is aborted, so after a peer dies a host blocked
  // in a synchronization behind one (a graphed step's copy, a loss read)
  // stays blocked instead of getting the error within the timeout. With
  // the group's ProcessGroupOptions::peer_collectives, the group's own
  // kernel all-reduces them instead, and ends within the timeout.
  bool registered_buffers = false;
  // Rank 0's buffers are broadcast at construction and before each forward
  // whose backward synchronises (not inside no_sync(), not without grad),
  // as in PyTorch: the ranks' forward passes see one set of buffers.
  bool broadcast_buffers = true;
};

class DistributedDataParallel {
 public:
  DistributedDataParallel(std::shared_ptr<nn::Module> module, std::shared_ptr<ProcessGroup> group,
                          DdpOptions options = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  // Runs the module and prepares the reducer for the backward of its output.
  Tensor forward(const Tensor& x);
  Tensor operator()(const Tensor& x) { return forward(x); }

  // For modules with another signature: call before their forward (and
  // pass its output to after_forward() when find_unused_parameters is on).
  void before_forward();
  void after_forward(const Tensor& output);

  class NoSyncGuard {
   public:
    explicit NoSyncGuard(DistributedDataParallel& ddp);
    ~NoSyncGuard();
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    DistributedDataParallel& ddp_;
    bool previous_;
  };
  // While the guard lives, forward/backward pairs accumulate locally.
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  // Overlaps the last bucket's all-reduce with the optimizer step `scaler`
  // takes: that bucket's gradients are checked for inf/NaN on every rank and
  // the flags all-reduced ahead of them, backward returns without waiting
  // for them, and scaler.step(optimizer) steps the other parameters while
  // they travel, the last bucket's once they have arrived, on one decision
  // (an average of finite values, divided before it is summed, is finite).
  // Until scaler.unscale_() or step() ran, the last bucket's gradients are
  // not final: read them after those, or after wait_for_gradients(). Not
  // with compression or find_unused_parameters (ValueError); at most one
  // scaler.
  void overlap_step_with(amp::GradScaler& scaler);
  // Makes every gradient of the last backward final (a no-op unless
  // overlap_step_with left the last bucket travelling).
  void wait_for_gradients();

  // found_inf (one element, any float dtype) becomes the maximum over the
  // ranks, so every rank skips or takes the same optimizer step.
  void allreduce_found_inf(const Tensor& found_inf);

  nn::Module& module() { return *module_; }
  ProcessGroup& group() { return *group_; }
  // Parameter indices per bucket (in nn::Module::parameters() order).
  std::vector<std::vector<size_t>> bucket_assignment() const;
  bool buckets_rebuilt() const;
  // Bytes of the group's registered memory the buckets hold (0 without
  // registered_buffers, or when the backend has none): memory the caching
  // allocator's statistics do not count.
  int64_t registered_bytes() const;

 private:
  struct Reducer;
  void broadcast_buffers();
  std::shared_ptr<nn::Module> module_;
  std::shared_ptr<ProcessGroup> group_;
  std::shared_ptr<Reducer> reducer_;  // the hooks hold it weakly
};

// The same for code that has a process group but no DDP object.
void allreduce_found_inf(ProcessGroup& group, const Tensor& found_inf);

}  // namespace mpt::dist
