#pragma once
// mpt-bench --mode allreduce: the time of one all-reduce across every GPU of
// this process (a thread and an NCCL group rank per GPU), for a range of
// sizes and each way of running it:
//   nccl       NCCL on ordinary memory (DDP's default);
//   symmetric  NCCL on a registered symmetric window (DdpOptions::registered_buffers);
//   peer       the group's own kernel on memory every GPU maps
//              (ProcessGroupOptions::peer_collectives).
// Each rank records `per_replay` all-reduces into a CUDA graph, as a DDP
// step replays its bucket all-reduces, and times replays with CUDA events;
// the slowest rank's median over the replays, divided by `per_replay`, is
// one all-reduce. Prints one JSON line per (way, size), with NCCL's bus
// bandwidth convention: bytes * 2 * (ranks - 1) / ranks / time.
#include <cstdint>
#include <string>
#include <vector>

#include "tensor/dtype.h"

namespace mpt::bench {

struct AllreduceSweepOptions {
  std::vector<std::string> ways = {"nccl", "symmetric", "peer"};
  std::vector<int64_t> sizes_kib = {64, 256, 1024, 4096, 16384, 65536};
  DType dtype = DType::f32;
  int warmup = 5;       // replays before the timed ones
  int replays = 20;     // timed replays (the median is reported)
  int per_replay = 10;  // all-reduces in one graph
};

int run_allreduce_sweep(const AllreduceSweepOptions& o);

}  // namespace mpt::bench
