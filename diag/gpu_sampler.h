#pragma once
// Reads utilisation and memory of the GPUs a run uses through NVML, about
// once a second, on a thread of its own (never the training thread), and
// hands each reading and each idle-device warning to callbacks.
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

namespace mpt::diag {

class GpuSampler {
 public:
  using Record = std::function<void(const nlohmann::ordered_json&)>;
  using Warn = std::function<void(const std::string&)>;
  // `cuda_devices`: CUDA indices. Without NVML or devices it does not start;
  // reason() says why.
  GpuSampler(const std::vector<int>& cuda_devices, std::chrono::milliseconds period, Record record, Warn warn);
  ~GpuSampler();  // stops the thread
  GpuSampler(const GpuSampler&) = delete;
  GpuSampler& operator=(const GpuSampler&) = delete;

  bool running() const { return thread_.joinable(); }
  const std::string& reason() const { return reason_; }

 private:
  void loop(std::vector<int> cuda, std::vector<int> nvml_index);

  std::chrono::milliseconds period_;
  Record record_;
  Warn warn_;
  std::string reason_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace mpt::diag
