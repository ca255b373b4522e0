#include "parallel/process_group.h"

#include "parallel/gloo_process_group.h"
#include "parallel/nccl_process_group.h"

namespace mpt::dist {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
  }
  return "?";
}

void check_collective_tensor(const char* op, const Tensor& t, DeviceType expected) {
  check<ValueError>(t.defined(), "{}: undefined tensor", op);
  check<DeviceError>(t.device().type == expected, "{}: {} is on {}, but this process group's backend serves {}",
                     op, describe(t), t.device().str(), expected == DeviceType::cpu ? "cpu" : "cuda");
  check<ValueError>(t.is_contiguous(), "{}: {} is not contiguous; collectives work on contiguous tensors", op,
                    describe(t));
}

Tensor ProcessGroup::registered_buffer(int64_t, DType, const Device&) { return Tensor(); }

std::shared_ptr<ProcessGroup> new_process_group(const std::shared_ptr<Store>& store, int rank, int size,
                                                DeviceType device_type, const ProcessGroupOptions& options,
                                                int device) {
  check<ValueError>(store != nullptr, "new_process_group: null store");
  check<ValueError>(size >= 1 && rank >= 0 && rank < size, "new_process_group: rank {} outside 0..{}", rank,
                    size - 1);
  if (device_type == DeviceType::cpu) return new_gloo_process_group(store, rank, size, options);
  return new_nccl_process_group(store, rank, size, device, options);
}

}  // namespace mpt::dist
