#pragma once
// Forwards to a real group and counts the all-reduces, so tests can see
// when DDP communicates (during backward, not inside no_sync()).
#include <atomic>

#include "parallel/process_group.h"

namespace mpt::testing {

class CountingGroup : public dist::ProcessGroup {
 public:
  explicit CountingGroup(dist::ProcessGroup& inner) : ProcessGroup(inner.rank(), inner.size()), inner_(inner) {}
  std::string backend_name() const override { return inner_.backend_name(); }
  dist::WorkPtr allreduce(const Tensor& t, dist::ReduceOp op) override {
    ++allreduces;
    return inner_.allreduce(t, op);
  }
  dist::WorkPtr broadcast(const Tensor& t, int root) override { return inner_.broadcast(t, root); }
  dist::WorkPtr allgather(const std::vector<Tensor>& o, const Tensor& i) override { return inner_.allgather(o, i); }
  dist::WorkPtr reduce_scatter(const Tensor& o, const Tensor& i, dist::ReduceOp op) override {
    return inner_.reduce_scatter(o, i, op);
  }
  dist::WorkPtr barrier() override { return inner_.barrier(); }
  Tensor registered_buffer(int64_t numel, DType dtype, const Device& device) override {
    return inner_.registered_buffer(numel, dtype, device);
  }

  std::atomic<int> allreduces{0};

 private:
  dist::ProcessGroup& inner_;
};

}  // namespace mpt::testing
