#pragma once
// NVML (the NVIDIA Management Library), loaded at run time with
// dlopen("libnvidia-ml.so.1"). The library comes with the driver, not the
// toolkit, and a machine without a GPU has no driver: nothing links against
// it, so every build runs everywhere and says why NVML is missing.
//
// Device indices here are NVML's (every GPU of the machine, in PCI order),
// which differ from CUDA's when CUDA_VISIBLE_DEVICES is set; index_of_pci_bus_id()
// maps a CUDA device (cuda_pci_bus_id() in tensor/cuda_info.h) to NVML's index.
#include <cstdint>
#include <optional>
#include <string>

namespace mpt::nvml {

struct GpuInfo {
  std::string name;
  std::string pci_bus_id;  // "00000000:3B:00.0"
  uint64_t memory_total = 0;  // bytes
  int compute_major = 0, compute_minor = 0;
};

// One reading of a device's counters.
struct GpuSample {
  unsigned utilization = 0;  // percent of the last sample period with a kernel running
  uint64_t memory_used = 0, memory_total = 0;  // bytes
};

// How two GPUs are connected: NVLink (with the number of active links on
// the first device), or PCIe through the nearest common ancestor
// (nvidia-smi topo's PIX, PXB, PHB, NODE, SYS).
struct Link {
  bool nvlink = false;
  int nvlink_count = 0;
  std::string pcie_path;  // "PIX", "PXB", "PHB", "NODE", "SYS", or "" when unknown
  std::string str() const;  // "NVLink (18 links)", "PCIe (PHB)"
};

class Library {
 public:
  // The process-wide instance, loaded and initialised on first use.
  // NotAvailableError("NVML not available: <reason>") when there is none
  // (no libnvidia-ml.so.1, a missing symbol, nvmlInit failing); the same
  // error each time it is asked.
  static const Library& get();
  // The same, as nullptr with the reason in *why.
  static const Library* try_get(std::string* why = nullptr);

  std::string driver_version() const;  // "550.54.15"
  int cuda_driver_version() const;     // the newest CUDA the driver supports, 12040 = 12.4
  int device_count() const;
  GpuInfo info(int index) const;
  GpuSample sample(int index) const;
  Link link(int a, int b) const;
  std::optional<int> index_of_pci_bus_id(const std::string& bus_id) const;

  struct Api;  // the loaded entry points (nvml.cpp)

 private:
  explicit Library(const Api* api) : api_(api) {}
  const Api* api_;
};

}  // namespace mpt::nvml
