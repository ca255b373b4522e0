#pragma once
#include <string>

namespace mpt {

enum class DeviceType : uint8_t { cpu, cuda };

// A place where tensor memory lives: the host, or one CUDA GPU by index.
// On the CPU, index > 0 names a "virtual" CPU device: same memory, separate
// identity, so the single-process data-parallel code runs (and is tested)
// without a GPU.
struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;

  Device() = default;
  Device(DeviceType t, int i = 0) : type(t), index(i) {}
  // "cpu", "cpu:1", "cuda", "cuda:0".
  explicit Device(const std::string& spec);
  Device(const char* spec) : Device(std::string(spec)) {}

  bool is_cpu() const { return type == DeviceType::cpu; }
  bool is_cuda() const { return type == DeviceType::cuda; }
  std::string str() const;

  friend bool operator==(const Device& a, const Device& b) { return a.type == b.type && a.index == b.index; }
  friend bool operator!=(const Device& a, const Device& b) { return !(a == b); }
};

inline const Device kCPU{DeviceType::cpu, 0};

// Whether this build has CUDA and how many GPUs the process sees (0 without).
bool cuda_built();
int cuda_device_count();
// Throws DeviceError unless `d` is usable here: "cuda:1 requested, but ..."
void check_device_available(const Device& d);

}  // namespace mpt
