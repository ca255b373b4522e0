// DataParallel's in-process NCCL clique: one communicator per device, made
// together by ncclCommInitAll. A collective is one NCCL group call over
// every device's current stream: a ring over NVLink/PCIe, with no card
// gathering the others' data, and no host synchronisation.
#include <nccl.h>

#include "parallel/cuda/nccl_util.h"
#include "parallel/local_communicator.h"
#include "tensor/cuda/check.h"
#include "tensor/cuda/runtime.h"
#include "tensor/device_guard.h"
#include "tensor/operand_check.h"

namespace mpt::dist {

namespace {

class NcclLocalCommunicator : public LocalCommunicator {
 public:
  explicit NcclLocalCommunicator(const std::vector<Device>& devices) : devices_(devices) {
    nccl::check_version();
    std::vector<int> ids;
    for (const auto& d : devices) {
      check<DeviceError>(d.is_cuda(), "NCCL clique: {} is not a CUDA device", d.str());
      check_device_available(d);
      ids.push_back(d.index);
    }
    comms_.resize(devices.size());
    MPT_NCCL_CHECK(ncclCommInitAll(comms_.data(), static_cast<int>(ids.size()), ids.data()));
  }
  ~NcclLocalCommunicator() override {
    for (ncclComm_t c : comms_)
      if (c) MPT_NCCL_RELEASE(ncclCommDestroy(c));
  }

  void allreduce_sum(const std::vector<Tensor>& ts) override { allreduce_sum_all({ts}); }
  void broadcast(const std::vector<Tensor>& ts, size_t root) override { broadcast_all({ts}, root); }

  void allreduce_sum_all(const std::vector<std::vector<Tensor>>& sets) override {
    for (const auto& ts : sets) {
      check_tensors("allreduce_sum", ts);
      check_no_float8("LocalCommunicator::allreduce_sum", ts.at(0));
    }
    grouped(sets, [&](const Tensor& t, size_t i) {
      MPT_NCCL_CHECK(ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), nccl::data_type(t.dtype()), ncclSum,
                                   comms_[i], cuda::current_cuda_stream(devices_[i].index)));
    });
  }

  void broadcast_all(const std::vector<std::vector<Tensor>>& sets, size_t root) override {
    check<ValueError>(root < devices_.size(), "LocalCommunicator::broadcast: root {} outside 0..{}", root,
                      devices_.size() - 1);
    for (const auto& ts : sets) check_tensors("broadcast", ts);
    grouped(sets, [&](const Tensor& t, size_t i) {
      MPT_NCCL_CHECK(ncclBroadcast(t.data_ptr(), t.data_ptr(), t.numel(), nccl::data_type(t.dtype()),
                                   static_cast<int>(root), comms_[i], cuda::current_cuda_stream(devices_[i].index)));
    });
  }

 private:
  void check_tensors(const char* op, const std::vector<Tensor>& ts) const {
    check<ValueError>(ts.size() == devices_.size(), "LocalCommunicator::{}: {} tensors for {} devices", op, ts.size(),
                      devices_.size());
    for (size_t i = 0; i < ts.size(); ++i) {
      check<DeviceError>(ts[i].device() == devices_[i], "LocalCommunicator::{}: tensor {} is {}, expected on {}", op,
                         i, describe(ts[i]), devices_[i].str());
      check<ShapeError>(ts[i].shape() == ts[0].shape() && ts[i].dtype() == ts[0].dtype() && ts[i].is_contiguous(),
                        "LocalCommunicator::{}: {} does not match {} (or is not contiguous)", op, describe(ts[i]),
                        describe(ts[0]));
    }
  }

  // Issues op(tensor, device) for every tensor of every set inside NCCL
  // groups (NCCL aggregates a group's operations into few launches), at
  // most kMaxGroupOps operations per group.
  template <typename Op>
  void grouped(const std::vector<std::vector<Tensor>>& sets, Op&& op) {
    constexpr size_t kMaxGroupOps = 2048;
    size_t in_group = 0;
    bool open = false;  // a group to close if an operation throws (and only then)
    auto start = [&] {
      MPT_NCCL_CHECK(ncclGroupStart());
      open = true;
    };
    auto end = [&] {
      open = false;
      MPT_NCCL_CHECK(ncclGroupEnd());
    };
    try {
      start();
      for (const auto& ts : sets) {
        if (in_group + ts.size() > kMaxGroupOps) {
          end();
          start();
          in_group = 0;
        }
        for (size_t i = 0; i < ts.size(); ++i) op(ts[i], i);
        in_group += ts.size();
      }
      end();
    } catch (...) {
      if (open) MPT_NCCL_RELEASE(ncclGroupEnd());
      throw;
    }
  }

  std::vector<Device> devices_;
  std::vector<ncclComm_t> comms_;
};

}  // namespace

std::unique_ptr<LocalCommunicator> new_nccl_local_communicator(const std::vector<Device>& devices) {
  return std::make_unique<NcclLocalCommunicator>(devices);
}

}  // namespace mpt::dist
