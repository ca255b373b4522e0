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
      if (c) ncclCommDestroy(c);
  }

  void allreduce_sum(const std::vector<Tensor>& ts) override {
    check_tensors("allreduce_sum", ts);
    MPT_NCCL_CHECK(ncclGroupStart());
    for (size_t i = 0; i < ts.size(); ++i)
      MPT_NCCL_CHECK(ncclAllReduce(ts[i].data_ptr(), ts[i].data_ptr(), ts[i].numel(), nccl::data_type(ts[i].dtype()),
                                   ncclSum, comms_[i], cuda::current_cuda_stream(devices_[i].index)));
    MPT_NCCL_CHECK(ncclGroupEnd());
  }

  void broadcast(const std::vector<Tensor>& ts, size_t root) override {
    check_tensors("broadcast", ts);
    check<ValueError>(root < ts.size(), "LocalCommunicator::broadcast: root {} outside 0..{}", root, ts.size() - 1);
    MPT_NCCL_CHECK(ncclGroupStart());
    for (size_t i = 0; i < ts.size(); ++i)
      MPT_NCCL_CHECK(ncclBroadcast(ts[i].data_ptr(), ts[i].data_ptr(), ts[i].numel(), nccl::data_type(ts[i].dtype()),
                                   static_cast<int>(root), comms_[i], cuda::current_cuda_stream(devices_[i].index)));
    MPT_NCCL_CHECK(ncclGroupEnd());
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

  std::vector<Device> devices_;
  std::vector<ncclComm_t> comms_;
};

}  // namespace

std::unique_ptr<LocalCommunicator> new_nccl_local_communicator(const std::vector<Device>& devices) {
  return std::make_unique<NcclLocalCommunicator>(devices);
}

}  // namespace mpt::dist
