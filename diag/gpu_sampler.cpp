#include "diag/gpu_sampler.h"

#include <fmt/format.h>

#include "tensor/cuda_info.h"
#include "tensor/error.h"
#include "diag/nvml.h"
#include "diag/training_warnings.h"

namespace mpt::diag {

GpuSampler::GpuSampler(const std::vector<int>& cuda_devices, std::chrono::milliseconds period, Record record,
                       Warn warn)
    : period_(period), record_(std::move(record)), warn_(std::move(warn)) {
  if (cuda_devices.empty()) {
    reason_ = "no GPU in use";
    return;
  }
  std::string why;
  const nvml::Library* nvml = nvml::Library::try_get(&why);
  if (!nvml) {
    reason_ = "NVML not available: " + why;
    return;
  }
  // NVML counts every GPU of the machine; CUDA only the visible ones.
  std::vector<int> nvml_index;
  for (int d : cuda_devices) {
    const auto i = nvml->index_of_pci_bus_id(cuda::pci_bus_id(d));
    if (!i) {
      reason_ = fmt::format("NVML does not know cuda:{}", d);
      return;
    }
    nvml_index.push_back(*i);
  }
  thread_ = std::thread(&GpuSampler::loop, this, cuda_devices, nvml_index);
}

GpuSampler::~GpuSampler() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void GpuSampler::loop(std::vector<int> cuda, std::vector<int> nvml_index) {
  const nvml::Library& nvml = nvml::Library::get();
  std::vector<std::string> names;
  for (int d : cuda) names.push_back(fmt::format("cuda:{}", d));
  IdleDetector idle(names);
  const auto start = std::chrono::steady_clock::now();
  std::unique_lock lock(mutex_);
  while (!wake_.wait_for(lock, period_, [this] { return stop_; })) {
    lock.unlock();
    try {
      nlohmann::ordered_json devices = nlohmann::ordered_json::array();
      std::vector<unsigned> utilization;
      for (size_t k = 0; k < cuda.size(); ++k) {
        const nvml::GpuSample s = nvml.sample(nvml_index[k]);
        utilization.push_back(s.utilization);
        devices.push_back({{"device", names[k]},
                           {"utilization", s.utilization},
                           {"memory_used_mb", static_cast<double>(s.memory_used) / (1 << 20)},
                           {"memory_total_mb", static_cast<double>(s.memory_total) / (1 << 20)}});
      }
      const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      record_({{"event", "gpu"}, {"seconds", t}, {"devices", std::move(devices)}});
      if (auto w = idle.update(utilization)) warn_(*w);
    } catch (const Error& e) {
      warn_(fmt::format("warning: GPU sampler stopped: {}", e.what()));
      return;
    }
    lock.lock();
  }
}

}  // namespace mpt::diag
