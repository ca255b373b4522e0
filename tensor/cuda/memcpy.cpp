// memcpy_between (tensor/device_memory.h): raw byte copies where at least one
// side is a CUDA device.
#include <cstring>
#include <mutex>
#include <set>
#include <utility>

#include "tensor/cuda/check.h"
#include "tensor/cuda/index_check.h"
#include "tensor/cuda/event_pool.h"
#include "tensor/cuda/host_allocator.h"
#include "tensor/cuda/runtime.h"
#include "tensor/device_guard.h"
#include "tensor/device_memory.h"

namespace mpt {
namespace {

// Direct peer access makes device-to-device copies go over NVLink/PCIe
// instead of being staged through the host. Enabled once per ordered pair,
// where the hardware allows it.
void enable_peer_access(int from, int to) {
  static std::mutex mutex;
  static auto* tried = new std::set<std::pair<int, int>>();  // leaked: used until exit
  std::lock_guard<std::mutex> lock(mutex);
  if (!tried->insert({from, to}).second) return;
  int can = 0;
  MPT_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, from, to));
  if (!can) return;
  DeviceGuard guard(cuda::cuda_device(from));
  const cudaError_t status = cudaDeviceEnablePeerAccess(to, 0);
  if (status == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();
    return;
  }
  MPT_CUDA_CHECK(status);
}

// dst_stream must not read before src_stream has produced the data, and
// src_stream must not reuse the source (its memory may be freed and handed
// out again on src_stream) before dst_stream has read it.
void copy_device_to_device(void* dst, int dst_index, const void* src, int src_index, size_t nbytes) {
  const cudaStream_t src_stream = cuda::current_cuda_stream(src_index);
  const cudaStream_t dst_stream = cuda::current_cuda_stream(dst_index);
  enable_peer_access(dst_index, src_index);

  cudaEvent_t ready = cuda::acquire_event(src_index);
  {
    DeviceGuard guard(cuda::cuda_device(src_index));
    MPT_CUDA_CHECK(cudaEventRecord(ready, src_stream));
  }
  cudaEvent_t done = cuda::acquire_event(dst_index);
  {
    DeviceGuard guard(cuda::cuda_device(dst_index));
    MPT_CUDA_CHECK(cudaStreamWaitEvent(dst_stream, ready, 0));
    MPT_CUDA_CHECK(cudaMemcpyPeerAsync(dst, dst_index, src, src_index, nbytes, dst_stream));
    MPT_CUDA_CHECK(cudaEventRecord(done, dst_stream));
  }
  {
    DeviceGuard guard(cuda::cuda_device(src_index));
    MPT_CUDA_CHECK(cudaStreamWaitEvent(src_stream, done, 0));
  }
  cuda::release_event(src_index, ready);
  cuda::release_event(dst_index, done);
}

}  // namespace

void memcpy_between(void* dst, const Device& dst_device, const void* src, const Device& src_device, size_t nbytes) {
  if (nbytes == 0) return;
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memcpy(dst, src, nbytes);
    return;
  }
  for (const Device* d : {&dst_device, &src_device}) check_device_available(*d);

  if (src_device.is_cpu()) {
    // From pageable host memory the call returns once the source has been
    // staged, so the caller may free or overwrite it right away. From pinned
    // memory it returns at once; the host cache keeps the block from being
    // reused until the copy is done (writing into a live pinned tensor
    // meanwhile is the caller's race, as with PyTorch's non_blocking).
    DeviceGuard guard(dst_device);
    const cudaStream_t stream = cuda::current_cuda_stream(dst_device.index);
    MPT_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyHostToDevice, stream));
    cuda::record_pinned_use(src, dst_device.index, stream);
    return;
  }
  if (dst_device.is_cpu()) {
    DeviceGuard guard(src_device);
    const cudaStream_t stream = cuda::current_cuda_stream(src_device.index);
    // Wait for the stream first: a copy into pageable memory waits for the
    // stream inside the driver, holding the device's lock, and another
    // thread that must still enqueue work on this device for the stream's
    // work to finish (a peer rank of an in-process NCCL group) would hang.
    MPT_CUDA_CHECK(cudaStreamSynchronize(stream));
    MPT_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToHost, stream));
    MPT_CUDA_CHECK(cudaStreamSynchronize(stream));
    cuda::raise_index_check_failure(src_device.index);
    return;
  }
  if (src_device.index == dst_device.index) {
    DeviceGuard guard(dst_device);
    MPT_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice, cuda::current_cuda_stream(dst_device.index)));
    return;
  }
  copy_device_to_device(dst, dst_device.index, src, src_device.index, nbytes);
}

}  // namespace mpt
