#pragma once
// The kernel behind PeerAllReduce: an in-place all-reduce of a buffer that
// lies at the same offset in every rank's peer-readable memory, each GPU
// reading the others' memory directly (NVLink or PCIe peer access).
//
// Two passes, as a reduce-scatter then an all-gather: rank r sums chunk r
// over every rank (in rank order, so every rank ends with the same bits)
// and writes it in place; then it copies every other chunk from the rank
// that owns it. Block b of every rank handles the same elements of each
// chunk, so the ranks' blocks b meet (flags written into each other's
// memory) only with each other: before the first pass (every rank's input
// is ready), between the passes (every chunk is summed) and after the
// second (nobody reads this rank's memory any more, so the next fill may
// overwrite it). Three meetings of a few microseconds each, against the
// tens NCCL spends on a small all-reduce.
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
constexpr int kMeetings = 3;
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
