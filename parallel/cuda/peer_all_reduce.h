#pragma once
// PeerAllReduce: all-reduces of f32, f16 and bf16 tensors by our own kernel
// (peer_all_reduce_kernel.h), each GPU reading the other ranks' memory
// directly, for ranks whose GPUs are on one host and can read each other's
// memory (NVLink or PCIe peer access). Ranks in one process share device
// pointers; ranks in different processes share CUDA IPC handles through the
// store.
//
// Why not NCCL: a small all-reduce is latency. NCCL's ring kernels spend
// tens of microseconds on mlp_small's 7.5 MB; its symmetric kernels cut
// that but were seen to keep waiting for a dead peer after the
// communicator's abort. This kernel's every wait is bounded by the timeout
// and by an abort word the host sets, so a failure ends within the timeout
// wherever the host is blocked.
//
// Every rank makes the same calls in the same order, on one stream at a
// time: buffer() (collective), then all-reduces of tensors at the same
// offsets of the same buffer. After a launch gave up (status()), the
// ranks' flags are out of step: make a new one.
#include <cuda_runtime.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "parallel/process_group.h"
#include "parallel/store.h"
#include "tensor/tensor.h"

namespace mpt::dist {

class PeerAllReduce : public std::enable_shared_from_this<PeerAllReduce> {
 public:
  // Collective over `store` (its keys under `prefix`), on `device`. Null on
  // every rank, with `why` naming the first rank that cannot and the
  // reason, when some rank cannot map every other rank's memory (another
  // host, no peer access between two GPUs, more than 8 ranks).
  static std::shared_ptr<PeerAllReduce> connect(std::shared_ptr<Store> store, const std::string& prefix, int rank,
                                                int world, int device, Millis timeout, std::string& why);
  ~PeerAllReduce();
  PeerAllReduce(const PeerAllReduce&) = delete;
  PeerAllReduce& operator=(const PeerAllReduce&) = delete;

  // Collective: `numel` elements of `dtype` in memory every rank maps. The
  // memory lives as long as this object (the tensor holds it).
  Tensor buffer(int64_t numel, DType dtype);

  // Whether allreduce(t, op) runs here: t is contiguous, f32, f16 or bf16,
  // inside one of buffer()'s, and op is a sum or an average.
  bool serves(const Tensor& t, ReduceOp op) const;

  // Queues the all-reduce of t (in place) on `stream`. DistributedError
  // once a launch gave up.
  void enqueue(const Tensor& t, ReduceOp op, cudaStream_t stream);

  // "" while every launch so far met its peers; else why one gave up.
  std::string failure() const;
  // True when failure() is a timeout.
  bool timed_out() const;

  // Ends every wait of launched kernels at once (they record "aborted");
  // nothing may be launched after it, and the memory is left mapped.
  void abort();

 private:
  struct Shared;  // one allocation and every rank's address of it
  PeerAllReduce(std::shared_ptr<Store> store, std::string prefix, int rank, int world, int device, Millis timeout,
                std::vector<bool> same_process);
  // Collective: a new allocation of `bytes`, zeroed, with every rank's
  // counterpart mapped here; exchange() does it into `s`, which share()
  // releases when it fails.
  std::unique_ptr<Shared> share(size_t bytes);
  void exchange(Shared& s);
  // Frees what this rank allocated and closes what it mapped.
  void release();
  // The buffer holding t, when allreduce(t, op) runs here (see serves()).
  const Shared* region_of(const Tensor& t, ReduceOp op) const;
  int status() const;

  std::shared_ptr<Store> store_;
  const std::string prefix_;
  const int rank_, world_, device_;
  const Millis timeout_;
  const std::vector<bool> same_process_;  // per rank: in this process (device pointers, no IPC)
  int shares_ = 0;                        // allocations shared so far: names their store keys
  std::unique_ptr<Shared> flags_;
  std::vector<std::unique_ptr<Shared>> buffers_;
  uint32_t* calls_ = nullptr;  // per block, on this GPU
  int* host_words_ = nullptr;    // host-mapped: [0] status, [1] abort
  int* device_words_ = nullptr;  // the same words as the kernels address them
  std::atomic<bool> aborted_{false};
};

}  // namespace mpt::dist
