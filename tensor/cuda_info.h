#pragma once
// What the CUDA runtime and libraries this build uses say about themselves
// and the GPUs this process sees: versions, device properties and peer
// access. For diagnostics (mpt-doctor, the start of a training run); a
// build without CUDA answers with built = false and no devices.
#include <cstdint>
#include <string>
#include <vector>

namespace mpt::cuda {

// Versions as the libraries encode them: CUDA 12040 = 12.4, cuBLAS
// 120402 = 12.4.2, cuDNN 90100 = 9.1.0. 0: not known (no driver, say).
struct Versions {
  bool built = false;       // this build has the CUDA backend
  int driver = 0;           // cudaDriverGetVersion: the newest CUDA the driver supports
  int runtime = 0;          // cudaRuntimeGetVersion of the loaded libcudart
  int cublas = 0;           // cublasGetVersion of the loaded libcublas
  int cudnn_compiled = 0;   // CUDNN_VERSION of cudnn.h at build time
  int cudnn_loaded = 0;     // cudnnGetVersion of the loaded libcudnn
  std::string device_count_error;  // why cudaGetDeviceCount failed ("" when it did not)
};
Versions versions();

struct DeviceProperties {
  int index = 0;  // CUDA's index (after CUDA_VISIBLE_DEVICES)
  std::string name;
  std::string pci_bus_id;  // as NVML writes it, to find the same GPU there
  uint64_t memory_total = 0, memory_free = 0;  // bytes
  int compute_major = 0, compute_minor = 0;
  int multiprocessors = 0;
};
// Every device this process sees (none in a build without CUDA).
std::vector<DeviceProperties> device_properties();
DeviceProperties device_properties(int index);

// The PCI bus id alone, without touching the device (no CUDA context is
// made, so a process may ask about GPUs that other ranks drive).
std::string pci_bus_id(int index);

// cudaDeviceCanAccessPeer(a, b).
bool can_access_peer(int a, int b);

// Why mptrain's GPU kernels cannot run on a GPU of this compute capability
// ("" when they can). They use Ampere's instructions (bf16 mma.sync,
// cp.async) and are built for sm_80 and newer.
inline constexpr int kMinComputeMajor = 8;
std::string unsupported_compute_capability(int major, int minor);

// "12.4" from 12040; "9.1.0" from cuDNN's 90100.
std::string cuda_version_text(int v);
std::string cudnn_version_text(int v);

}  // namespace mpt::cuda
