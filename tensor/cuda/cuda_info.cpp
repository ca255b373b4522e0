// tensor/cuda_info.h for the CUDA build.
#include "tensor/cuda_info.h"

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <fmt/format.h>

#include "tensor/cuda/check.h"
#include "tensor/device.h"
#include "tensor/device_guard.h"

namespace mpt::cuda {

Versions versions() {
  Versions v;
  v.built = true;
  // Each of these answers without a GPU; a failure leaves the field 0.
  if (cudaDriverGetVersion(&v.driver) != cudaSuccess) v.driver = 0;
  if (cudaRuntimeGetVersion(&v.runtime) != cudaSuccess) v.runtime = 0;
  v.cublas = static_cast<int>(cublasLtGetVersion());
  v.cudnn_compiled = CUDNN_VERSION;
  v.cudnn_loaded = static_cast<int>(cudnnGetVersion());
  int count = 0;
  if (const cudaError_t s = cudaGetDeviceCount(&count); s != cudaSuccess) {
    v.device_count_error = fmt::format("{}: {}", cudaGetErrorName(s), cudaGetErrorString(s));
    (void)cudaGetLastError();
  }
  return v;
}

DeviceProperties device_properties(int index) {
  check_device_available(Device(DeviceType::cuda, index));
  cudaDeviceProp p{};
  MPT_CUDA_CHECK(cudaGetDeviceProperties(&p, index));
  DeviceProperties d;
  d.index = index;
  d.name = p.name;
  d.compute_major = p.major;
  d.compute_minor = p.minor;
  d.multiprocessors = p.multiProcessorCount;
  d.memory_total = p.totalGlobalMem;
  d.pci_bus_id = pci_bus_id(index);
  DeviceGuard guard(Device(DeviceType::cuda, index));
  size_t free = 0, total = 0;
  MPT_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  d.memory_free = free;
  return d;
}

std::vector<DeviceProperties> device_properties() {
  std::vector<DeviceProperties> out;
  for (int i = 0; i < cuda_device_count(); ++i) out.push_back(device_properties(i));
  return out;
}

std::string pci_bus_id(int index) {
  check_device_available(Device(DeviceType::cuda, index));
  char bus_id[32] = {};
  MPT_CUDA_CHECK(cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, index));
  return bus_id;
}

bool can_access_peer(int a, int b) {
  if (a == b) return true;
  int yes = 0;
  MPT_CUDA_CHECK(cudaDeviceCanAccessPeer(&yes, a, b));
  return yes != 0;
}

}  // namespace mpt::cuda
