// The CUDA entry points of the tensor core in a build without CUDA: asking
// for a CUDA device fails with a DeviceError that says why, and everything
// that merely touches the CPU keeps working.
#include <cstring>

#include <fmt/format.h>

#include "tensor/cpu/host_block_cache.h"
#include "tensor/cuda/attention_cudnn.h"
#include "tensor/cuda/conv_cudnn.h"
#include "tensor/cuda/gemm.h"
#include "tensor/cuda/graph.h"
#include "tensor/cuda/index_check.h"
#include "tensor/cuda_info.h"
#include "tensor/device.h"
#include "tensor/device_memory.h"
#include "tensor/error.h"
#include "tensor/gpu_timeline.h"
#include "tensor/memory.h"
#include "tensor/nvtx.h"
#include "tensor/stream.h"

namespace mpt {
namespace {

[[noreturn]] void no_cuda(int index) {
  throw DeviceError(fmt::format(
      "cuda:{} requested, but this build of mptrain has no CUDA support (configure with the CUDA toolkit installed)",
      index));
}

void require_cpu(const Device& d) {
  if (d.is_cuda()) no_cuda(d.index);
}

}  // namespace

bool cuda_built() { return false; }
int cuda_device_count() { return 0; }
void check_device_available(const Device& d) { require_cpu(d); }

// ---- streams and events: CPU work is synchronous, so these do nothing ----------

Stream Stream::create(const Device& device, int) {
  require_cpu(device);
  return Stream(device, nullptr);
}
void Stream::synchronize() const { require_cpu(device_); }
Stream current_stream(const Device& device) {
  require_cpu(device);
  return Stream(device, nullptr);
}
void set_current_stream(const Stream& s) { require_cpu(s.device()); }
void synchronize(const Device& device) { require_cpu(device); }

Event::Event(const Device& device, bool) : device_(device) { require_cpu(device); }
Event::~Event() = default;
void Event::record(const Stream& s) { require_cpu(s.device()); }
void Event::record_external(const Stream& s) { require_cpu(s.device()); }
void Event::wait(const Stream& s) const { require_cpu(s.device()); }
void Event::synchronize() const {}
bool Event::query() const { return true; }
float Event::elapsed_ms(const Event&) const {
  throw ValueError("Event::elapsed_ms: timing needs CUDA events, and this build has no CUDA support");
}

// ---- memory -------------------------------------------------------------------

MemoryStats memory_stats(const Device& device) {
  require_cpu(device);
  return host_cache::stats();
}
void reset_peak_memory_stats(const Device& device) {
  require_cpu(device);
  host_cache::reset_peak();
}
void empty_cache() { host_cache::empty(); }
void record_stream(void*, const Stream& stream) { require_cpu(stream.device()); }

std::shared_ptr<Storage> cuda_storage(size_t, const Device& device) {
  no_cuda(device.is_cuda() ? device.index : 0);
}

std::shared_ptr<Storage> pinned_host_storage(size_t) { return nullptr; }
bool is_pinned_host_memory(const void*) { return false; }

void memcpy_between(void* dst, const Device& dst_device, const void* src, const Device& src_device, size_t nbytes) {
  require_cpu(dst_device);
  require_cpu(src_device);
  if (nbytes) std::memcpy(dst, src, nbytes);
}

// ---- tensor/cuda/gemm.h, conv_cudnn.h and attention_cudnn.h, so that tools can set them in any build

namespace cuda {
void set_allow_tf32(bool) {}
bool allow_tf32() { return false; }
void set_conv_autotune(bool) {}
bool conv_autotune() { return false; }
void set_cudnn_attention(bool) {}
bool cudnn_attention() { return false; }
std::string last_attention_kernel(bool) { return ""; }

// ---- tensor/cuda/graph.h: CapturedStep never makes one on the CPU ----------------
struct Graph::State {};
Graph::Graph(int device) { no_cuda(device); }
Graph::~Graph() = default;
void Graph::capture(const std::function<void()>&) { no_cuda(0); }
void Graph::replay() { no_cuda(0); }
void watch_replays(const std::shared_ptr<ReplayWatch>&) {}

void enqueue_index_check(const char*, const Tensor& indices, int64_t, std::optional<int64_t>) {
  no_cuda(indices.device().index);
}

// ---- tensor/cuda_info.h: a build without CUDA has no versions and no devices -------

Versions versions() { return {}; }
std::vector<DeviceProperties> device_properties() { return {}; }
DeviceProperties device_properties(int index) { no_cuda(index); }
std::string pci_bus_id(int index) { no_cuda(index); }
bool can_access_peer(int a, int) { no_cuda(a); }
}  // namespace cuda

// ---- tensor/nvtx.h: no profiler ranges without CUDA --------------------------------

void nvtx_push(const char*) {}
void nvtx_pop() {}

// ---- tensor/gpu_timeline.h: a GPU's timer needs a GPU -----------------------------

GpuTimeline::GpuTimeline(const Device& device, int capacity) : device_(device), capacity_(capacity) {
  throw DeviceError(fmt::format("GpuTimeline: needs a CUDA device ({} asked), and this build of mptrain has no CUDA "
                                "support",
                                device.str()));
}
GpuTimeline::~GpuTimeline() = default;
void GpuTimeline::begin_step() {}
void GpuTimeline::stamp(const std::string&, void*) {}
std::vector<std::pair<std::string, double>> GpuTimeline::read() const { return {}; }

}  // namespace mpt
