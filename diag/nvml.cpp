#include "diag/nvml.h"

#include <dlfcn.h>

#include <fmt/format.h>

#include "tensor/error.h"

namespace mpt::nvml {
namespace {

// The few NVML types used here, as nvml.h declares them (a stable C ABI;
// the header is not needed, as the library is not linked).
using nvmlReturn_t = int;
constexpr nvmlReturn_t NVML_SUCCESS = 0;
struct nvmlDevice_st;
using nvmlDevice_t = nvmlDevice_st*;
struct nvmlMemory_t {
  unsigned long long total, free, used;
};
struct nvmlUtilization_t {
  unsigned gpu, memory;
};
struct nvmlPciInfo_t {  // nvmlDeviceGetPciInfo_v3's layout
  char busIdLegacy[16];
  unsigned domain, bus, device, pciDeviceId, pciSubSystemId;
  char busId[32];
};
constexpr int NVML_FEATURE_ENABLED = 1;
constexpr int NVML_P2P_CAPS_INDEX_NVLINK = 2;
constexpr int NVML_P2P_STATUS_OK = 0;
constexpr unsigned NVML_NVLINK_MAX_LINKS = 18;

}  // namespace

struct Library::Api {
  nvmlReturn_t (*init)();
  const char* (*error_string)(nvmlReturn_t);
  nvmlReturn_t (*driver_version)(char*, unsigned);
  nvmlReturn_t (*cuda_driver_version)(int*);
  nvmlReturn_t (*device_count)(unsigned*);
  nvmlReturn_t (*handle_by_index)(unsigned, nvmlDevice_t*);
  nvmlReturn_t (*handle_by_pci_bus_id)(const char*, nvmlDevice_t*);
  nvmlReturn_t (*name)(nvmlDevice_t, char*, unsigned);
  nvmlReturn_t (*memory)(nvmlDevice_t, nvmlMemory_t*);
  nvmlReturn_t (*utilization)(nvmlDevice_t, nvmlUtilization_t*);
  nvmlReturn_t (*compute_capability)(nvmlDevice_t, int*, int*);
  nvmlReturn_t (*pci_info)(nvmlDevice_t, nvmlPciInfo_t*);
  nvmlReturn_t (*nvlink_state)(nvmlDevice_t, unsigned, int*);
  nvmlReturn_t (*p2p_status)(nvmlDevice_t, nvmlDevice_t, int, int*);
  nvmlReturn_t (*common_ancestor)(nvmlDevice_t, nvmlDevice_t, int*);

  // Throws CudaError naming the call and NVML's text for a failed status.
  void check(nvmlReturn_t status, const char* call) const {
    if (status != NVML_SUCCESS)
      throw CudaError(fmt::format("NVML {} failed: {} (status {})", call, error_string(status), status));
  }
  nvmlDevice_t handle(int index) const {
    nvmlDevice_t d = nullptr;
    check(handle_by_index(static_cast<unsigned>(index), &d), "nvmlDeviceGetHandleByIndex_v2");
    return d;
  }
};

namespace {

struct Loaded {
  Library::Api api{};
  std::string error;  // empty when loaded
};

template <typename F>
bool bind(void* lib, const char* symbol, F& f, std::string& error) {
  f = reinterpret_cast<F>(::dlsym(lib, symbol));
  if (!f && error.empty()) error = fmt::format("libnvidia-ml.so.1 has no {} (a driver older than NVML 11?)", symbol);
  return f != nullptr;
}

Loaded load() {
  Loaded out;
  // Loaded for the life of the process: NVML keeps its own state, and
  // unloading a driver library while threads may sample it gains nothing.
  void* lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* e = ::dlerror();
    out.error = fmt::format("cannot load libnvidia-ml.so.1 ({}); it comes with the NVIDIA driver",
                            e ? e : "unknown error");
    return out;
  }
  Library::Api& a = out.api;
  std::string& e = out.error;
  bind(lib, "nvmlInit_v2", a.init, e);
  bind(lib, "nvmlErrorString", a.error_string, e);
  bind(lib, "nvmlSystemGetDriverVersion", a.driver_version, e);
  bind(lib, "nvmlSystemGetCudaDriverVersion_v2", a.cuda_driver_version, e);
  bind(lib, "nvmlDeviceGetCount_v2", a.device_count, e);
  bind(lib, "nvmlDeviceGetHandleByIndex_v2", a.handle_by_index, e);
  bind(lib, "nvmlDeviceGetHandleByPciBusId_v2", a.handle_by_pci_bus_id, e);
  bind(lib, "nvmlDeviceGetName", a.name, e);
  bind(lib, "nvmlDeviceGetMemoryInfo", a.memory, e);
  bind(lib, "nvmlDeviceGetUtilizationRates", a.utilization, e);
  bind(lib, "nvmlDeviceGetCudaComputeCapability", a.compute_capability, e);
  bind(lib, "nvmlDeviceGetPciInfo_v3", a.pci_info, e);
  bind(lib, "nvmlDeviceGetNvLinkState", a.nvlink_state, e);
  bind(lib, "nvmlDeviceGetP2PStatus", a.p2p_status, e);
  bind(lib, "nvmlDeviceGetTopologyCommonAncestor", a.common_ancestor, e);
  if (!e.empty()) return out;
  if (const nvmlReturn_t s = a.init(); s != NVML_SUCCESS)
    e = fmt::format("nvmlInit failed: {} (status {}); is the NVIDIA driver loaded?", a.error_string(s), s);
  return out;
}

const Loaded& loaded() {
  static const Loaded l = load();
  return l;
}

std::string pcie_path_name(int level) {
  switch (level) {
    case 0: return "internal";  // the same board
    case 10: return "PIX";      // one PCIe switch
    case 20: return "PXB";      // several PCIe switches
    case 30: return "PHB";      // a PCIe host bridge
    case 40: return "NODE";     // host bridges of one NUMA node
    case 50: return "SYS";      // across NUMA nodes (SMP interconnect)
    default: return "";
  }
}

}  // namespace

std::string Link::str() const {
  if (nvlink) return fmt::format("NVLink ({} link{})", nvlink_count, nvlink_count == 1 ? "" : "s");
  return pcie_path.empty() ? "PCIe" : fmt::format("PCIe ({})", pcie_path);
}

const Library* Library::try_get(std::string* why) {
  const Loaded& l = loaded();
  if (!l.error.empty()) {
    if (why) *why = l.error;
    return nullptr;
  }
  static const Library library(&l.api);
  return &library;
}

const Library& Library::get() {
  std::string why;
  const Library* l = try_get(&why);
  if (!l) throw NotAvailableError("NVML not available: " + why);
  return *l;
}

std::string Library::driver_version() const {
  char text[96] = {};
  api_->check(api_->driver_version(text, sizeof text), "nvmlSystemGetDriverVersion");
  return text;
}

int Library::cuda_driver_version() const {
  int v = 0;
  api_->check(api_->cuda_driver_version(&v), "nvmlSystemGetCudaDriverVersion_v2");
  return v;
}

int Library::device_count() const {
  unsigned n = 0;
  api_->check(api_->device_count(&n), "nvmlDeviceGetCount_v2");
  return static_cast<int>(n);
}

GpuInfo Library::info(int index) const {
  const nvmlDevice_t d = api_->handle(index);
  GpuInfo g;
  char name[96] = {};
  api_->check(api_->name(d, name, sizeof name), "nvmlDeviceGetName");
  g.name = name;
  nvmlPciInfo_t pci{};
  api_->check(api_->pci_info(d, &pci), "nvmlDeviceGetPciInfo_v3");
  g.pci_bus_id = pci.busId;
  nvmlMemory_t m{};
  api_->check(api_->memory(d, &m), "nvmlDeviceGetMemoryInfo");
  g.memory_total = m.total;
  api_->check(api_->compute_capability(d, &g.compute_major, &g.compute_minor), "nvmlDeviceGetCudaComputeCapability");
  return g;
}

GpuSample Library::sample(int index) const {
  const nvmlDevice_t d = api_->handle(index);
  nvmlUtilization_t u{};
  api_->check(api_->utilization(d, &u), "nvmlDeviceGetUtilizationRates");
  nvmlMemory_t m{};
  api_->check(api_->memory(d, &m), "nvmlDeviceGetMemoryInfo");
  return {u.gpu, m.used, m.total};
}

Link Library::link(int a, int b) const {
  const nvmlDevice_t da = api_->handle(a), db = api_->handle(b);
  Link l;
  int status = -1;
  // Not every device answers these (NOT_SUPPORTED on GPUs without NVLink):
  // that is "no NVLink", not an error.
  if (api_->p2p_status(da, db, NVML_P2P_CAPS_INDEX_NVLINK, &status) == NVML_SUCCESS)
    l.nvlink = status == NVML_P2P_STATUS_OK;
  if (l.nvlink)
    for (unsigned link = 0; link < NVML_NVLINK_MAX_LINKS; ++link) {
      int state = 0;
      if (api_->nvlink_state(da, link, &state) == NVML_SUCCESS && state == NVML_FEATURE_ENABLED) ++l.nvlink_count;
    }
  int level = -1;
  if (api_->common_ancestor(da, db, &level) == NVML_SUCCESS) l.pcie_path = pcie_path_name(level);
  return l;
}

std::optional<int> Library::index_of_pci_bus_id(const std::string& bus_id) const {
  nvmlDevice_t wanted = nullptr;
  if (api_->handle_by_pci_bus_id(bus_id.c_str(), &wanted) != NVML_SUCCESS) return std::nullopt;
  for (int i = 0, n = device_count(); i < n; ++i)
    if (api_->handle(i) == wanted) return i;
  return std::nullopt;
}

}  // namespace mpt::nvml
