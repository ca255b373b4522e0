#pragma once
// The kernel behind PeerAllReduce: an in-place all-reduce of a buffer that
// lies at the same offset in every rank's peer-readable memory, each GPU
// reading the others' memory directly (NVLink or PCIe peer access).
//
// One pass: rank r owns chunk r of the tensor; it reads that chunk from
// every rank, sums it (in rank order, so every rank gets the same bits) and
// writes the result into every rank's memory. Block b of every rank handles
// the same units of each chunk, so the ranks' blocks b meet (flags written
// into each other's memory) only with each other: before the pass (every
// rank's input is ready) and after it (every write into this rank's memory
// is done, and nobody reads it any more, so the next fill may overwrite
// it). Two meetings of a few microseconds each, against the tens NCCL
// spends on a small all-reduce. Between two GPUs each direction of the link
// carries the tensor's bytes once, as NCCL's ring does.
//
// Every wait is bounded: a block that waits past the timeout, or that
// finds the host's abort word set, records why in the host-mapped status
// word and ends, so a dead peer never leaves a kernel (or a graph replay)
// waiting forever. The flags are then out of step: the caller must not
// launch again.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "tensor/dtype.h"

namespace mpt::dist::peer {

constexpr int kMaxRanks = 8;
constexpr int kMaxBlocks = 64;
constexpr int kMeetings = 2;
// A rank's flag words, written by its peers: [meeting][block][from rank].
constexpr size_t kFlagWords = size_t(kMeetings) * kMaxBlocks * kMaxRanks;

// The status word's values.
enum Status : int { kRunning = 0, kTimedOut = 1, kAborted = 2 };

struct Args {
  void* data[kMaxRanks] = {};        // the tensor's first element in each rank's memory (same offset)
  uint32_t* flags[kMaxRanks] = {};   // each rank's flag words (kFlagWords)
  uint32_t* calls = nullptr;         // this rank's count of launches, per block (kMaxBlocks), on its GPU
  int* status = nullptr;             // host-mapped: kRunning, or why a block gave up
  const int* abort = nullptr;        // host-mapped: nonzero ends every wait
  int rank = 0;
  int world = 0;
  int64_t numel = 0;
  float scale = 1;                   // applied to the sum: 1, or 1/world for an average
  uint64_t timeout_ns = 0;           // each wait's bound, from the kernel's start
};

// The blocks a launch for a tensor of `bytes` uses: the same on every rank
// (the flags pair blocks by index), and few, since the kernel runs beside
// backward's kernels and NVLink fills with a few dozen SMs' loads.
int blocks_for(int64_t bytes, int world);

// Launches the kernel for `dtype` (f32, f16 or bf16) on `stream`. 16-byte
// loads when the tensor's first element is 16-byte aligned (its offset is
// the same on every rank, so every rank takes the same path).
cudaError_t launch_all_reduce(const Args& args, DType dtype, cudaStream_t stream);

}  // namespace mpt::dist::peer
