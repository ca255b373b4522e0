#include "parallel/local_communicator.h"

#include "tensor/operand_check.h"
#include "tensor/ops.h"

namespace mpt::dist {

namespace {

void check_per_device(const char* op, const std::vector<Tensor>& ts, size_t n) {
  check<ValueError>(ts.size() == n, "{}: {} tensors for {} devices", op, ts.size(), n);
  for (const auto& t : ts)
    check<ShapeError>(t.shape() == ts[0].shape() && t.dtype() == ts[0].dtype(), "{}: {} does not match {}", op,
                      describe(t), describe(ts[0]));
}

// Virtual CPU devices share the host's memory: the sum is formed once, in
// device order (so results do not depend on thread timing), and copied out.
class CpuLocalCommunicator : public LocalCommunicator {
 public:
  explicit CpuLocalCommunicator(size_t n) : n_(n) {}

  void allreduce_sum(const std::vector<Tensor>& per_device) override {
    check_per_device("LocalCommunicator::allreduce_sum", per_device, n_);
    check_no_float8("LocalCommunicator::allreduce_sum", per_device[0]);  // (a sum of one device's tensor too)
    Tensor sum = prim::clone(per_device[0]);
    for (size_t i = 1; i < n_; ++i) prim::binary_(BinaryOp::add, sum, sum, prim::to(per_device[i], sum.device()));
    for (const auto& t : per_device) prim::copy_(t, sum);
  }

  void broadcast(const std::vector<Tensor>& per_device, size_t root) override {
    check_per_device("LocalCommunicator::broadcast", per_device, n_);
    check<ValueError>(root < n_, "LocalCommunicator::broadcast: root {} outside 0..{}", root, n_ - 1);
    for (size_t i = 0; i < n_; ++i)
      if (i != root) prim::copy_(per_device[i], per_device[root]);
  }

 private:
  size_t n_;
};

}  // namespace

std::unique_ptr<LocalCommunicator> new_local_communicator(const std::vector<Device>& devices) {
  check<ValueError>(!devices.empty(), "new_local_communicator: no devices");
  if (devices[0].is_cpu()) return std::make_unique<CpuLocalCommunicator>(devices.size());
  return new_nccl_local_communicator(devices);
}

}  // namespace mpt::dist
