#pragma once
// The checks of mpt-doctor, each filling its own sections of the report.
#include <string>
#include <vector>

#include "parallel/store.h"
#include "diag/report.h"

namespace mpt::diag {

// Host, build, driver and runtime versions, cuBLAS, cuDNN and NCCL (compiled
// against and loaded), every GPU (CUDA's view and NVML's utilisation), and
// the peer-access matrix with the link type between each pair.
void check_system(Report& report);

// Whether this machine has an NVIDIA GPU: NVML (which comes with the
// driver) or the CUDA runtime sees one. Where neither does, the report
// leaves out what only applies to GPUs (CUDA_VISIBLE_DEVICES, NCCL's
// variables, the NCCL all-reduce).
bool machine_has_gpu();

// The distributed variables (set, missing or malformed), whether
// MASTER_PORT is free here, whether MASTER_ADDR resolves, and whether rank
// 0's store answers there (greeted as a rank greets it).
void check_environment(Report& report, dist::Millis connect_timeout);

struct CommOptions {
  std::vector<size_t> sizes;  // bytes per allreduce
  int gloo_ranks = 2;
  int iterations = 5;         // timed calls per size (after one warm-up)
  dist::Millis timeout{30000};
};
// All-reduce smoke tests: Gloo over CPU ranks (threads with their own
// TcpStore and TCP connections), and NCCL over every local GPU (one
// process, DataParallel's NCCL clique). Sums are checked element by
// element; times are reported as nccl-tests does (algbw, busbw).
void check_comm(Report& report, const CommOptions& options);

}  // namespace mpt::diag
