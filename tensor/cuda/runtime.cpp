// The CUDA side of tensor/device.h and tensor/stream.h: device discovery,
// streams and events; plus the current-device helpers of runtime.h.
#include "tensor/cuda/runtime.h"

#include <array>
#include <atomic>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "tensor/cuda/check.h"
#include "tensor/cuda/index_check.h"
#include "tensor/cuda_info.h"
#include "tensor/device_guard.h"
#include "tensor/error.h"
#include "tensor/stream.h"

namespace mpt {
namespace {

struct DeviceCount {
  int count = 0;
  cudaError_t status = cudaSuccess;
  std::vector<std::string> unsupported;  // per device: why the kernels cannot run there ("" when they can)
};

// Asked once: the answer cannot change within a process. Any failure means
// "no usable GPU" rather than an exception, so that a CUDA build still runs
// on the CPU of a machine without a GPU or a working driver; the reason is
// kept for check_device_available's message.
const DeviceCount& device_count_info() {
  static const DeviceCount info = [] {
    DeviceCount c;
    c.status = cudaGetDeviceCount(&c.count);
    if (c.status != cudaSuccess) {
      (void)cudaGetLastError();
      c.count = 0;
    }
    for (int i = 0; i < c.count; ++i) {
      int major = 0, minor = 0;
      if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, i) != cudaSuccess ||
          cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, i) != cudaSuccess) {
        (void)cudaGetLastError();
        c.unsupported.push_back("");  // left to the first call on it to report
        continue;
      }
      c.unsupported.push_back(cuda::unsupported_compute_capability(major, minor));
    }
    return c;
  }();
  return info;
}

const Device& checked_cuda(const Device& d) {
  check_device_available(d);
  return d;
}

// Per thread and device; nullptr is the legacy default stream.
thread_local std::vector<void*> t_current_streams;

}  // namespace

bool cuda_built() { return true; }

int cuda_device_count() { return device_count_info().count; }

void check_device_available(const Device& d) {
  if (d.is_cpu()) return;
  const DeviceCount& info = device_count_info();
  if (d.index >= 0 && d.index < info.count) return;
  if (info.count == 0) {
    const std::string reason = info.status == cudaSuccess
                                   ? std::string("it reports 0 devices")
                                   : fmt::format("{}: {}", cudaGetErrorName(info.status),
                                                 cudaGetErrorString(info.status));
    throw DeviceError(fmt::format("cuda:{} requested, but no CUDA device is available (cudaGetDeviceCount: {})",
                                  d.index, reason));
  }
  throw DeviceError(fmt::format("cuda:{} requested, but this machine has {} CUDA device{}", d.index, info.count,
                                info.count == 1 ? "" : "s"));
}

namespace cuda {

void check_device_usable(const Device& d) {
  check_device_available(d);
  if (d.is_cpu()) return;
  const std::string& unsupported = device_count_info().unsupported[static_cast<size_t>(d.index)];
  check<DeviceError>(unsupported.empty(), "cuda:{} cannot hold tensors: it has {}; train on the CPU instead",
                     d.index, unsupported);
}

}  // namespace cuda

// ---- devices and streams, internal -----------------------------------------------

namespace cuda {

int current_device() {
  int d = 0;
  MPT_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

int multiprocessor_count(int device) {
  static std::array<std::atomic<int>, 64> cache{};
  if (device >= 0 && device < static_cast<int>(cache.size())) {
    if (const int n = cache[device].load(std::memory_order_relaxed); n > 0) return n;
  }
  int n = 0;
  MPT_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  if (device >= 0 && device < static_cast<int>(cache.size())) cache[device].store(n, std::memory_order_relaxed);
  return n;
}

cudaStream_t current_cuda_stream(int device) {
  return device < static_cast<int>(t_current_streams.size()) ? static_cast<cudaStream_t>(t_current_streams[device])
                                                              : nullptr;
}

cudaStream_t current_cuda_stream() { return current_cuda_stream(current_device()); }

}  // namespace cuda

// ---- streams --------------------------------------------------------------------

Stream Stream::create(const Device& device, int priority) {
  if (device.is_cpu()) return Stream(device, nullptr);
  DeviceGuard guard(checked_cuda(device));
  cudaStream_t s = nullptr;
  // Never destroyed: a Stream is a plain handle that may be copied anywhere,
  // so the stream it names must outlive every copy (PyTorch does the same).
  MPT_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, priority));
  return Stream(device, s);
}

void Stream::synchronize() const {
  if (device_.is_cpu()) return;
  DeviceGuard guard(device_);  // the legacy default stream (nullptr) means "of the current device"
  MPT_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(handle_)));
  cuda::raise_index_check_failure(device_.index);
}

Stream current_stream(const Device& device) {
  if (device.is_cpu()) return Stream(device, nullptr);
  return Stream(device, cuda::current_cuda_stream(checked_cuda(device).index));
}

void set_current_stream(const Stream& s) {
  if (s.device().is_cpu()) return;
  const int index = checked_cuda(s.device()).index;
  if (index >= static_cast<int>(t_current_streams.size())) t_current_streams.resize(index + 1, nullptr);
  t_current_streams[index] = s.handle();
}

void synchronize(const Device& device) {
  if (device.is_cpu()) return;
  DeviceGuard guard(checked_cuda(device));
  MPT_CUDA_CHECK(cudaDeviceSynchronize());
  cuda::raise_index_check_failure(device.index);
}

// ---- events ---------------------------------------------------------------------

Event::Event(const Device& device, bool timing) : device_(device) {
  if (device.is_cpu()) return;
  DeviceGuard guard(checked_cuda(device));
  cudaEvent_t e = nullptr;
  MPT_CUDA_CHECK(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming));
  handle_ = e;
}

Event::~Event() {
  // Errors are ignored: a destructor cannot throw, and at process exit the
  // driver may already be gone.
  if (handle_ && cudaEventDestroy(static_cast<cudaEvent_t>(handle_)) != cudaSuccess) (void)cudaGetLastError();
}

void Event::record(const Stream& s) {
  if (!handle_) return;
  check<DeviceError>(s.device() == device_, "Event::record: the event belongs to {}, the stream to {}",
                     device_.str(), s.device().str());
  DeviceGuard guard(device_);
  MPT_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(handle_), static_cast<cudaStream_t>(s.handle())));
}

void Event::record_external(const Stream& s) {
  if (!handle_) return;
  check<DeviceError>(s.device() == device_, "Event::record_external: the event belongs to {}, the stream to {}",
                     device_.str(), s.device().str());
  DeviceGuard guard(device_);
  const auto stream = static_cast<cudaStream_t>(s.handle());
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  MPT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
  MPT_CUDA_CHECK(cudaEventRecordWithFlags(static_cast<cudaEvent_t>(handle_), stream,
                                          capturing == cudaStreamCaptureStatusActive ? cudaEventRecordExternal
                                                                                     : cudaEventRecordDefault));
}

void Event::wait(const Stream& s) const {
  if (!handle_) return;
  if (s.device().is_cpu()) {
    // CPU work runs synchronously on the calling thread, so for a CPU stream
    // "wait" can only mean: block until the event has happened.
    synchronize();
    return;
  }
  DeviceGuard guard(s.device());  // a stream may wait on another device's event
  MPT_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(s.handle()), static_cast<cudaEvent_t>(handle_), 0));
}

void Event::synchronize() const {
  if (!handle_) return;
  MPT_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(handle_)));
  cuda::raise_index_check_failure(device_.index);
}

bool Event::query() const {
  if (!handle_) return true;
  const cudaError_t status = cudaEventQuery(static_cast<cudaEvent_t>(handle_));
  if (status == cudaErrorNotReady) {
    (void)cudaGetLastError();  // "not ready" is an answer, not an error to report later
    return false;
  }
  MPT_CUDA_CHECK(status);
  return true;
}

float Event::elapsed_ms(const Event& end) const {
  check<ValueError>(handle_ && end.handle_, "Event::elapsed_ms: timing needs two CUDA events (got {} and {})",
                    device_.str(), end.device_.str());
  float ms = 0.0f;
  // Fails with cudaErrorInvalidResourceHandle unless both were created with
  // timing = true, and with cudaErrorNotReady until both have completed.
  MPT_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(handle_), static_cast<cudaEvent_t>(end.handle_)));
  return ms;
}

}  // namespace mpt
