#include "tensor/gpu_timeline.h"

#include "tensor/cuda/check.h"
#include "tensor/cuda/gpu_timeline_kernel.h"
#include "tensor/cuda/runtime.h"
#include "tensor/device_guard.h"
#include "tensor/error.h"

namespace mpt {

GpuTimeline::GpuTimeline(const Device& device, int capacity) : device_(device), capacity_(capacity) {
  check<DeviceError>(device.is_cuda(), "GpuTimeline: needs a CUDA device, got {}", device.str());
  check<ValueError>(capacity > 0, "GpuTimeline: capacity must be positive, got {}", capacity);
  DeviceGuard guard(device_);
  // Plain cudaMalloc, outside the caching allocator: the slots must stay
  // where a captured graph's stamps write them.
  MPT_CUDA_CHECK(cudaMalloc(&stamps_, sizeof(uint64_t) * static_cast<size_t>(capacity)));
}

GpuTimeline::~GpuTimeline() {
  if (stamps_) MPT_CUDA_RELEASE(cudaFree(stamps_));
}

void GpuTimeline::begin_step() { labels_.clear(); }

void GpuTimeline::stamp(const std::string& label, void* stream) {
  if (static_cast<int>(labels_.size()) >= capacity_) return;
  DeviceGuard guard(device_);
  const auto s = stream ? static_cast<cudaStream_t>(stream) : cuda::current_cuda_stream(device_.index);
  cuda::launch_gpu_stamp(stamps_ + labels_.size(), s);
  labels_.push_back(label);
}

std::vector<std::pair<std::string, double>> GpuTimeline::read() const {
  DeviceGuard guard(device_);
  MPT_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint64_t> ns(labels_.size());
  if (!ns.empty())
    MPT_CUDA_CHECK(cudaMemcpy(ns.data(), stamps_, sizeof(uint64_t) * ns.size(), cudaMemcpyDeviceToHost));
  std::vector<std::pair<std::string, double>> out;
  for (size_t i = 0; i < ns.size(); ++i)
    out.emplace_back(labels_[i], static_cast<double>(static_cast<int64_t>(ns[i] - ns[0])) / 1e3);
  return out;
}

}  // namespace mpt
