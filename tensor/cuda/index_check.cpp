// Index checks on the GPU: one kernel per checked tensor (index_check.cu)
// records the first index outside its range in host-mapped pinned memory
// (one slot per device); the host looks at the slot after every
// synchronization, when the kernels before it have finished, so the check
// costs no extra sync.
#include <array>
#include <mutex>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "tensor/cuda/check.h"
#include "tensor/cuda/index_check.h"
#include "tensor/cuda/runtime.h"
#include "tensor/device_guard.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace mpt::cuda {
namespace {

using Failure = IndexCheckFailure;

constexpr int kMaxDevices = 64;

struct Slots {
  std::mutex mutex;
  std::array<Failure*, kMaxDevices> host{};    // mapped pinned memory, host view
  std::array<Failure*, kMaxDevices> device{};  // the same memory as kernels see it
  std::vector<std::string> ops;                // op names by id
};

Slots& slots() {
  static auto* s = new Slots();  // leaked: kernels may still write at exit
  return *s;
}

// The device pointer of `device`'s slot, made on first use.
Failure* slot_for(int device) {
  Slots& s = slots();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.device[device]) {
    DeviceGuard guard(cuda_device(device));
    void* host = nullptr;
    MPT_CUDA_CHECK(cudaHostAlloc(&host, sizeof(Failure), cudaHostAllocMapped | cudaHostAllocPortable));
    *static_cast<Failure*>(host) = Failure{};
    void* dev = nullptr;
    MPT_CUDA_CHECK(cudaHostGetDevicePointer(&dev, host, 0));
    s.host[device] = static_cast<Failure*>(host);
    s.device[device] = static_cast<Failure*>(dev);
  }
  return s.device[device];
}

int op_id(const char* op) {
  Slots& s = slots();
  std::lock_guard<std::mutex> lock(s.mutex);
  for (size_t i = 0; i < s.ops.size(); ++i)
    if (s.ops[i] == op) return static_cast<int>(i);
  s.ops.emplace_back(op);
  return static_cast<int>(s.ops.size() - 1);
}

}  // namespace

void enqueue_index_check(const char* op, const Tensor& indices, int64_t bound, std::optional<int64_t> ignore) {
  const int device = indices.device().index;
  check<DeviceError>(device >= 0 && device < kMaxDevices, "{}: CUDA device index {} out of range", op, device);
  Failure* slot = slot_for(device);
  const int id = op_id(op);
  DeviceGuard guard(indices.device());
  const Tensor idx = prim::contiguous(indices);
  const int64_t n = idx.numel();
  launch_index_check(current_cuda_stream(device), slot, idx.data_ptr(), idx.dtype() == DType::i64, n, bound,
                     ignore.has_value(), ignore.value_or(0), id);
}

void raise_index_check_failure(int device) {
  if (device < 0 || device >= kMaxDevices) return;
  Slots& s = slots();
  Failure* host = s.host[device];  // written once, before any kernel could use it
  if (!host || !reinterpret_cast<volatile Failure*>(host)->failed) return;
  std::string message;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    const Failure f = *host;
    message = fmt::format(
        "{}: index {} is out of range [0, {}){} (found on cuda:{} by the index check kernel, reported at the next "
        "synchronization; results computed from it since are not valid)",
        f.op >= 0 && f.op < static_cast<int>(s.ops.size()) ? s.ops[f.op] : std::string("index check"), f.index,
        f.bound, f.has_ignore ? fmt::format(" (ignore_index is {})", f.ignore) : std::string(), device);
    *host = Failure{};
  }
  throw ValueError(message);
}

}  // namespace mpt::cuda
