// The machine: build, driver, libraries and GPUs.
#include <fmt/format.h>

#include "parallel/nccl_info.h"
#include "tensor/cuda_info.h"
#include "tensor/device.h"
#include "tensor/error.h"
#include "tensor/host_name.h"
#include "diag/nvml.h"
#include "diag/checks.h"

namespace mpt::diag {
namespace {

std::string gib(uint64_t bytes) { return fmt::format("{:.1f} GiB", static_cast<double>(bytes) / (1ull << 30)); }

void check_libraries(Report& report, const cuda::Versions& v, const nvml::Library* nvml,
                     const std::string& nvml_error) {
  Section& s = report.add("software", "Driver and libraries");
  const std::string host = host_name();
  s.data["host"] = host;
  s.data["cuda_built"] = v.built;
  s.ok(fmt::format("host {}, mptrain built {} CUDA", host, v.built ? "with" : "without"));
  if (nvml) {
    s.data["driver"] = nvml->driver_version();
    s.data["driver_cuda"] = cuda::cuda_version_text(nvml->cuda_driver_version());
    s.ok(fmt::format("NVIDIA driver {} (supports CUDA up to {})", nvml->driver_version(),
                     cuda::cuda_version_text(nvml->cuda_driver_version())));
  } else {
    s.data["driver"] = nullptr;
    s.data["nvml_error"] = nvml_error;
    // NVML comes with the driver; so does the CUDA driver API that a CUDA
    // build asks for its version. Neither: there is no driver.
    if (v.driver == 0)
      s.note(fmt::format("no NVIDIA driver on this machine (NVML not available: {})", nvml_error));
    else
      s.note(fmt::format("NVML not available: {}", nvml_error));
  }
  if (!v.built) {
    s.note("no CUDA runtime, cuBLAS, cuDNN or NCCL in this build: training runs on the CPU (Gloo for ranks)");
    return;
  }
  s.data["cuda_runtime"] = cuda::cuda_version_text(v.runtime);
  s.data["cuda_driver_api"] = cuda::cuda_version_text(v.driver);
  s.data["cublas"] = v.cublas;
  s.data["cudnn_compiled"] = cuda::cudnn_version_text(v.cudnn_compiled);
  s.data["cudnn_loaded"] = cuda::cudnn_version_text(v.cudnn_loaded);
  s.ok(fmt::format("CUDA runtime {}, driver API {}", cuda::cuda_version_text(v.runtime),
                   cuda::cuda_version_text(v.driver)));
  if (v.driver > 0 && v.runtime > v.driver)
    s.problem(fmt::format("the CUDA runtime {} is newer than the driver supports ({})",
                          cuda::cuda_version_text(v.runtime), cuda::cuda_version_text(v.driver)),
              "install a driver that supports this CUDA version, or build mptrain with an older toolkit");
  s.ok(fmt::format("cuBLAS(Lt) {}.{}.{}", v.cublas / 10000, v.cublas / 100 % 100, v.cublas % 100));
  if (v.cudnn_loaded / 100 != v.cudnn_compiled / 100)
    s.warning(fmt::format("cuDNN: compiled against {}, loaded {}", cuda::cudnn_version_text(v.cudnn_compiled),
                          cuda::cudnn_version_text(v.cudnn_loaded)),
              "point LD_LIBRARY_PATH at the cuDNN the build used, or rebuild against the installed one");
  else
    s.ok(fmt::format("cuDNN {} (compiled against {})", cuda::cudnn_version_text(v.cudnn_loaded),
                     cuda::cudnn_version_text(v.cudnn_compiled)));

  const dist::NcclVersions nccl = dist::nccl_versions();
  s.data["nccl_compiled"] = dist::nccl_version_text(nccl.compiled);
  s.data["nccl_loaded"] = dist::nccl_version_text(nccl.loaded);
  const std::string both = fmt::format("NCCL: compiled against {}, loaded {}", dist::nccl_version_text(nccl.compiled),
                                       dist::nccl_version_text(nccl.loaded));
  if (nccl.loaded == 0)
    s.problem(fmt::format("{} (ncclGetVersion: {})", both, nccl.load_error),
              "install NCCL or point LD_LIBRARY_PATH at its libnccl.so.2");
  else if (!nccl.same_major_minor())
    s.problem(both + ": mptrain refuses another major.minor (the ABI may differ)",
              "point LD_LIBRARY_PATH at a libnccl of the version built against, or rebuild mptrain against this one");
  else if (nccl.loaded != nccl.compiled)
    s.warning(both + " (a patch release apart: works)",
              "nothing needed; rebuild against the loaded NCCL to silence this");
  else
    s.ok(both);
}

void check_gpus(Report& report, const cuda::Versions& v, const nvml::Library* nvml) {
  Section& s = report.add("gpus", "GPUs");
  s.data["machine_has_gpu"] = machine_has_gpu();
  s.data["devices"] = nlohmann::ordered_json::array();
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  const int count = cuda_device_count();
  s.data["count"] = count;
  if (count == 0) {
    std::string why = !v.built ? "this build has no CUDA"
                      : !v.device_count_error.empty() ? "cudaGetDeviceCount: " + v.device_count_error
                                                      : "the CUDA runtime reports 0 devices";
    if (nvml && nvml->device_count() > 0 && v.built)
      s.problem(fmt::format("no CUDA device ({}), but NVML sees {} GPU{}", why, nvml->device_count(),
                            nvml->device_count() == 1 ? "" : "s"),
                visible ? fmt::format("CUDA_VISIBLE_DEVICES='{}' hides them: unset it or name their indices", visible)
                        : "check the driver and the CUDA runtime versions above (nvidia-smi should list the GPUs)");
    else if (nvml && nvml->device_count() > 0)
      s.warning(fmt::format("no CUDA device ({}), but NVML sees {} GPU{}", why, nvml->device_count(),
                            nvml->device_count() == 1 ? "" : "s"),
                "build mptrain with the CUDA toolkit to train on them");
    else if (!nvml)  // NVML comes with every driver
      s.note("no NVIDIA driver or GPU on this machine: training runs on the CPU");
    else
      s.note(fmt::format("no NVIDIA GPU on this machine (driver {} installed): training runs on the CPU",
                         nvml->driver_version()));
    return;
  }
  // NVML first: reading the properties below makes a CUDA context on each
  // GPU, whose memory would count as another user's.
  std::vector<std::optional<int>> nvml_index(count);
  std::vector<std::optional<nvml::GpuSample>> before(count);
  for (int i = 0; i < count && nvml; ++i) {
    nvml_index[i] = nvml->index_of_pci_bus_id(cuda::pci_bus_id(i));
    if (nvml_index[i]) before[i] = nvml->sample(*nvml_index[i]);
  }
  for (int i = 0; i < count; ++i) {
    const cuda::DeviceProperties p = cuda::device_properties(i);
    nlohmann::ordered_json d = {{"index", i},
                                {"name", p.name},
                                {"pci_bus_id", p.pci_bus_id},
                                {"memory_total_bytes", p.memory_total},
                                {"memory_free_bytes", p.memory_free},
                                {"compute_capability", fmt::format("{}.{}", p.compute_major, p.compute_minor)},
                                {"multiprocessors", p.multiprocessors}};
    std::string line = fmt::format("cuda:{} {} ({}), {} of {} free, compute capability {}.{}, {} SMs", i, p.name,
                                   p.pci_bus_id, gib(p.memory_free), gib(p.memory_total), p.compute_major,
                                   p.compute_minor, p.multiprocessors);
    if (before[i]) {
      const nvml::GpuSample& now = *before[i];
      d["utilization_percent"] = now.utilization;
      d["memory_used_bytes"] = now.memory_used;
      line += fmt::format(", {}% busy, {} used", now.utilization, gib(now.memory_used));
      if (now.utilization > 10 || now.memory_used > (1ull << 30))  // a driver alone holds a few MiB
        s.warning(fmt::format("cuda:{} is already in use ({}% busy, {} used)", i, now.utilization,
                              gib(now.memory_used)),
                  "see nvidia-smi for the process using it; another job shares this GPU");
    }
    if (const std::string why = cuda::unsupported_compute_capability(p.compute_major, p.compute_minor); !why.empty())
      s.problem(fmt::format("cuda:{} has {}", i, why), "train on the CPU (--device cpu), or on a newer GPU");
    s.ok(line);
    s.data["devices"].push_back(std::move(d));
  }

  // Peer access and links, as a matrix (rows: from, columns: to).
  if (count < 2) return;
  nlohmann::ordered_json matrix = nlohmann::ordered_json::array();
  for (int a = 0; a < count; ++a) {
    nlohmann::ordered_json row = nlohmann::ordered_json::array();
    std::string line = fmt::format("cuda:{} ->", a);
    for (int b = 0; b < count; ++b) {
      if (a == b) {
        row.push_back({{"peer_access", true}, {"link", "self"}});
        line += "  self";
        continue;
      }
      const bool peer = cuda::can_access_peer(a, b);
      std::string link = "unknown (no NVML)";
      if (nvml_index[a] && nvml_index[b]) link = nvml->link(*nvml_index[a], *nvml_index[b]).str();
      row.push_back({{"peer_access", peer}, {"link", link}});
      line += fmt::format("  cuda:{} {}, {}", b, peer ? "peer access" : "NO peer access", link);
      if (!peer)
        s.warning(fmt::format("cuda:{} cannot access cuda:{} directly: NCCL goes through host memory", a, b),
                  "check the PCIe topology and IOMMU/ACS settings (nvidia-smi topo -m); a VM may hide peer access");
    }
    s.ok(line);
    matrix.push_back(std::move(row));
  }
  s.data["peer_matrix"] = std::move(matrix);
}

}  // namespace

bool machine_has_gpu() {
  const nvml::Library* nvml = nvml::Library::try_get();
  return (nvml && nvml->device_count() > 0) || cuda_device_count() > 0;
}

void check_system(Report& report) {
  std::string nvml_error;
  const nvml::Library* nvml = nvml::Library::try_get(&nvml_error);
  const cuda::Versions v = cuda::versions();
  check_libraries(report, v, nvml, nvml_error);
  check_gpus(report, v, nvml);
}

}  // namespace mpt::diag
