#pragma once
// ddp_worker's PeerAllReduce modes: two processes on cuda:0, so the kernel
// reads and writes the other rank's memory through CUDA IPC (as a process
// per GPU does on a multi-GPU host), on a one-GPU machine. The ranks meet
// through the env:// store alone (no process group).
//   peer_ipc         sums and averages in f32, f16 and bf16, aligned and
//                    not, then 50 calls in a row: bit for bit the rule
//                    (f32 sum in rank order, scaled, rounded once); prints
//                    "rank R: peer ipc ok"
//   peer_ipc_killed  both ranks map each other's memory and say "mapped";
//                    rank 1 then waits to be killed. Rank 0 launches an
//                    all-reduce (with MPT_TEST_LAUNCH_AFTER_KILL=1 only once
//                    the store saw rank 1 leave, so its kernel writes into
//                    the dead process's memory), says "launched", and waits
//                    for its stream: the kernel must give up at the timeout
//                    and the rank end with the reason (status 3)
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "parallel/cuda/peer_all_reduce.h"
#include "parallel/rendezvous.h"
#include "tensor/device_guard.h"
#include "tensor/ops.h"
#include "tensor/stream.h"

namespace mpt::testing {

struct PeerIpcCase {
  DType dtype;
  int64_t numel;
  int64_t offset;  // elements into the buffer: 16-byte packs, or one element at a time
  dist::ReduceOp op;
};

// Rank r's input for case k, the same in every process.
inline Tensor peer_ipc_input(const PeerIpcCase& c, size_t k, int r) {
  Generator gen(9000 + 10 * k + r);
  return prim::to(randn({c.numel}, DType::f32, kCPU, &gen), c.dtype);
}

inline void say(const std::string& line) {
  fmt::print("{}\n", line);
  std::fflush(stdout);
}

// `timeout` bounds the kernel's waits; meeting through the store may take
// longer (a process's first CUDA call alone can take seconds).
inline int peer_ipc_mode(const std::string& mode, dist::Millis timeout) {
  const dist::Rendezvous rv = dist::rendezvous("env://", std::max<dist::Millis>(timeout, std::chrono::seconds(60)));
  const int rank = rv.config.rank, world = rv.config.world_size;
  const Device dev(DeviceType::cuda, 0);
  DeviceGuard on_device(dev);
  const Stream stream = Stream::create(dev);
  StreamGuard on_stream(stream);
  const auto raw = static_cast<cudaStream_t>(stream.handle());
  std::string why;
  const auto peer = dist::PeerAllReduce::connect(rv.store, "peer-ipc", rank, world, 0, timeout, why);
  if (!peer) {
    fmt::print(stderr, "rank {}: no peer all-reduce: {}\n", rank, why);
    return 4;
  }

  if (mode == "peer_ipc") {
    const std::vector<PeerIpcCase> cases = {{DType::f32, 1000003, 0, dist::ReduceOp::avg},
                                            {DType::f32, 7, 1, dist::ReduceOp::sum},
                                            {DType::f16, 300001, 8, dist::ReduceOp::sum},
                                            {DType::f16, 4096 * 8 + 5, 3, dist::ReduceOp::avg},
                                            {DType::bf16, 65536, 0, dist::ReduceOp::avg}};
    std::map<DType, Tensor> buffers;
    for (DType d : {DType::f32, DType::f16, DType::bf16}) buffers[d] = peer->buffer(1000008, d);
    int wrong = 0;
    for (size_t k = 0; k < cases.size(); ++k) {
      const PeerIpcCase& c = cases[k];
      const Tensor part = prim::slice(buffers[c.dtype], 0, c.offset, c.offset + c.numel);
      prim::copy_(part, prim::to(peer_ipc_input(c, k, rank), dev));
      peer->enqueue(part, c.op, raw);
      Tensor sum = zeros({c.numel}, DType::f32, kCPU);
      for (int r = 0; r < world; ++r) sum = prim::add(sum, prim::to(peer_ipc_input(c, k, r), DType::f32));
      if (c.op == dist::ReduceOp::avg) sum = prim::mul(sum, scalar_tensor(1.0 / world, DType::f32));
      if (part.to_vector<double>() != prim::to(sum, c.dtype).to_vector<double>()) {
        fmt::print(stderr, "rank {}: case {} ({} x{} at {}) differs from the rule\n", rank, k, dtype_name(c.dtype),
                   c.numel, c.offset);
        ++wrong;
      }
    }
    const Tensor small = prim::slice(buffers[DType::f32], 0, 4, 68);
    for (int i = 0; i < 50; ++i) {
      prim::fill_(small, rank + i);
      peer->enqueue(small, dist::ReduceOp::sum, raw);
    }
    const double want = (world - 1) * world / 2.0 + world * 49.0;
    for (double v : small.to_vector<double>())
      if (v != want) {
        fmt::print(stderr, "rank {}: after 50 calls {} where {} was due\n", rank, v, want);
        ++wrong;
        break;
      }
    if (!peer->failure().empty()) fmt::print(stderr, "rank {}: {}\n", rank, peer->failure());
    if (wrong != 0 || !peer->failure().empty()) return 1;
    say(fmt::format("rank {}: peer ipc ok", rank));
    return 0;
  }

  if (mode == "peer_ipc_killed") {
    const Tensor buffer = peer->buffer(1 << 20, DType::f32);
    stream.synchronize();
    say(fmt::format("rank {}: mapped", rank));
    if (rank != 0) {
      std::this_thread::sleep_for(std::chrono::seconds(60));  // to be killed
      return 0;
    }
    const char* after = std::getenv("MPT_TEST_LAUNCH_AFTER_KILL");
    if (after != nullptr && std::string(after) == "1") {
      for (int i = 0; i < 600 && dist::departed_ranks(*rv.store, world).empty(); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      say("rank 0: rank 1 has left");
    }
    peer->enqueue(buffer, dist::ReduceOp::sum, raw);
    say("rank 0: launched");
    stream.synchronize();
    fmt::print(stderr, "rank 0: {}\n", peer->failure().empty() ? "the all-reduce completed" : peer->failure());
    return peer->failure().empty() ? 0 : 3;
  }
  fmt::print(stderr, "unknown mode '{}'\n", mode);
  return 2;
}

}  // namespace mpt::testing
