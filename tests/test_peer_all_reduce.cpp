// PeerAllReduce, the all-reduce kernel that reads the other ranks' GPU
// memory directly, on one GPU: two ranks as threads of this process share
// cuda:0, each with a stream of its own (one rank's kernel waits for the
// other's, so the two must run side by side). The sums and averages follow
// the written rule bit for bit on fresh random inputs; a rank that never
// arrives ends the kernel within the timeout, and an abort ends it at once.
// Two processes on cuda:0 share their memory through CUDA IPC, as a process
// per GPU does: the same rule holds, and a killed process ends its peer's
// kernel within the timeout. The two-GPU paths (NCCL groups and DDP with
// peer_collectives) are in test_parallel_gpu.cpp.
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <thread>

#include "parallel/child_process.h"
#include "parallel/distributed_error.h"
#include "parallel/launch.h"
#include "parallel/loopback_stores.h"
#include "tensor/device_guard.h"
#include "tensor/ops.h"
#include "tensor/stream.h"
#include "test_util.h"

#ifdef MPT_WITH_CUDA
#include "parallel/cuda/peer_all_reduce.h"
#include "tensor/cuda/check.h"
#endif

using namespace mpt;
using namespace mpt::dist;
using std::chrono::milliseconds;

#ifdef MPT_WITH_CUDA

namespace {

using Body = std::function<void(PeerAllReduce&, int rank, const Stream&)>;

// Two ranks on cuda:0, each connected through its own store client.
void with_two_peers_on_one_gpu(Millis timeout, const Body& body) {
  const auto stores = loopback_stores(2, milliseconds(20000));
  std::vector<std::exception_ptr> errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      try {
        const Device dev(DeviceType::cuda, 0);
        DeviceGuard on_device(dev);
        const Stream stream = Stream::create(dev);
        StreamGuard on_stream(stream);
        std::string why;
        const auto peer = PeerAllReduce::connect(stores[r], "test/peer", r, 2, 0, timeout, why);
        if (!peer) throw Error("PeerAllReduce::connect: " + why);
        body(*peer, r, stream);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : ranks) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

cudaStream_t raw(const Stream& s) { return static_cast<cudaStream_t>(s.handle()); }

struct Case {
  DType dtype;
  int64_t numel;
  int64_t offset;  // into the buffer, in elements: 16-byte packs or one element at a time
  dist::ReduceOp op;
};

}  // namespace

// Each case's two inputs summed in f32 in rank order, scaled (1 or 1/2) and
// rounded once to the dtype: the rule, computed on the CPU. Sizes from one
// element to several blocks' worth, with tails past the last 16-byte pack,
// at offsets that keep or break 16-byte alignment; then many small calls in
// a row, which keep the ranks' per-block counts in step.
TEST(PeerAllReduce, TwoRanksOnOneGpuSumAndAverageByTheRule) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = mpt::testing::fresh_seed();
  SCOPED_TRACE(seed);
  std::vector<Case> cases;
  for (DType d : {DType::f32, DType::f16, DType::bf16}) {
    cases.push_back({d, 1, 0, dist::ReduceOp::sum});
    cases.push_back({d, 5, 3, dist::ReduceOp::avg});
    cases.push_back({d, 4096 * 8 + 5, 0, dist::ReduceOp::sum});
    cases.push_back({d, 300001, 8, dist::ReduceOp::avg});
    cases.push_back({d, 2000000, 0, dist::ReduceOp::avg});
  }
  const int64_t capacity = 2000008;
  std::vector<std::array<Tensor, 2>> inputs;
  std::vector<Tensor> expected;
  Generator gen(seed);
  for (const Case& c : cases) {
    std::array<Tensor, 2> in;
    for (auto& t : in) t = prim::to(randn({c.numel}, DType::f32, kCPU, &gen), c.dtype);
    const Tensor sum = prim::add(prim::to(in[0], DType::f32), prim::to(in[1], DType::f32));
    expected.push_back(prim::to(c.op == dist::ReduceOp::avg ? prim::mul(sum, scalar_tensor(0.5, DType::f32)) : sum, c.dtype));
    inputs.push_back(in);
  }
  std::array<std::vector<std::vector<double>>, 2> results;
  std::array<std::vector<double>, 2> last_small;
  with_two_peers_on_one_gpu(milliseconds(20000), [&](PeerAllReduce& peer, int r, const Stream& stream) {
    const Device dev = stream.device();
    std::map<DType, Tensor> buffers;
    for (DType d : {DType::f32, DType::f16, DType::bf16}) buffers[d] = peer.buffer(capacity, d);
    for (size_t k = 0; k < cases.size(); ++k) {
      const Case& c = cases[k];
      const Tensor part = prim::slice(buffers[c.dtype], 0, c.offset, c.offset + c.numel);
      prim::copy_(part, prim::to(inputs[k][r], dev));
      ASSERT_TRUE(peer.serves(part, c.op));
      peer.enqueue(part, c.op, raw(stream));
      results[r].push_back(part.to_vector<double>());
    }
    const Tensor small = prim::slice(buffers[DType::f32], 0, 16, 80);
    for (int i = 0; i < 200; ++i) {
      prim::fill_(small, r + i);
      peer.enqueue(small, dist::ReduceOp::sum, raw(stream));
    }
    last_small[r] = small.to_vector<double>();
    EXPECT_EQ(peer.failure(), "");
  });
  for (size_t k = 0; k < cases.size(); ++k) {
    SCOPED_TRACE(fmt::format("case {}: {} x{} at {}, {}", k, dtype_name(cases[k].dtype), cases[k].numel,
                             cases[k].offset, reduce_op_name(cases[k].op)));
    const auto want = expected[k].to_vector<double>();
    EXPECT_EQ(results[0][k], want);
    EXPECT_EQ(results[1][k], want);
  }
  EXPECT_EQ(last_small[0], std::vector<double>(64, 0 + 199 + 1 + 199));
  EXPECT_EQ(last_small[1], last_small[0]);
}

// What the kernel does not serve (the group's NCCL path takes it): other
// ops and dtypes, tensors outside its buffers or not contiguous.
TEST(PeerAllReduce, ServesOnlySumsAndAveragesOfItsOwnContiguousFloats) {
  MPT_SKIP_WITHOUT_CUDA();
  with_two_peers_on_one_gpu(milliseconds(20000), [&](PeerAllReduce& peer, int, const Stream& stream) {
    const Tensor buffer = peer.buffer(64, DType::f32);
    EXPECT_TRUE(peer.serves(buffer, dist::ReduceOp::sum));
    EXPECT_FALSE(peer.serves(buffer, dist::ReduceOp::max));
    EXPECT_FALSE(peer.serves(zeros({64}, DType::f32, stream.device()), dist::ReduceOp::sum));
    EXPECT_FALSE(peer.serves(prim::slice(buffer, 0, 0, 16, 2), dist::ReduceOp::sum));
    const Tensor doubles = peer.buffer(8, DType::f64);
    EXPECT_FALSE(peer.serves(doubles, dist::ReduceOp::sum));
    EXPECT_THROW(peer.enqueue(doubles, dist::ReduceOp::sum, raw(stream)), ValueError);
  });
}

// Rank 1 never launches: rank 0's kernel gives up after the timeout by
// itself (its stream synchronizes), says so, and refuses later launches.
TEST(PeerAllReduce, ARankThatNeverArrivesEndsTheKernelWithinTheTimeout) {
  MPT_SKIP_WITHOUT_CUDA();
  std::atomic<bool> done{false};
  double took = -1;
  std::string why;
  bool timed_out = false, refused = false;
  with_two_peers_on_one_gpu(milliseconds(500), [&](PeerAllReduce& peer, int r, const Stream& stream) {
    const Tensor buffer = peer.buffer(1 << 20, DType::f32);
    if (r == 1) {  // keeps its memory (which rank 0's kernel writes flags into) until rank 0 is done
      while (!done) std::this_thread::sleep_for(milliseconds(5));
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    peer.enqueue(buffer, dist::ReduceOp::sum, raw(stream));
    stream.synchronize();
    took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    why = peer.failure();
    timed_out = peer.timed_out();
    try {
      peer.enqueue(buffer, dist::ReduceOp::sum, raw(stream));
    } catch (const DistributedError&) {
      refused = true;
    }
    done = true;
  });
  EXPECT_GE(took, 0.45);
  EXPECT_LT(took, 10.0);
  EXPECT_TRUE(timed_out);
  EXPECT_NE(why.find("rank 0 of 2 waited 500 ms for another rank's GPU"), std::string::npos) << why;
  EXPECT_TRUE(refused);
}

// With a long timeout, abort() ends a kernel that waits for a peer at once.
TEST(PeerAllReduce, AnAbortEndsAWaitingKernel) {
  MPT_SKIP_WITHOUT_CUDA();
  std::atomic<bool> done{false};
  double took = -1;
  bool waited = false, timed_out = true;
  std::string why;
  with_two_peers_on_one_gpu(milliseconds(60000), [&](PeerAllReduce& peer, int r, const Stream& stream) {
    const Tensor buffer = peer.buffer(1024, DType::f16);
    if (r == 1) {
      while (!done) std::this_thread::sleep_for(milliseconds(5));
      return;
    }
    peer.enqueue(buffer, dist::ReduceOp::avg, raw(stream));
    std::this_thread::sleep_for(milliseconds(200));
    waited = cudaStreamQuery(raw(stream)) == cudaErrorNotReady;
    const auto start = std::chrono::steady_clock::now();
    peer.abort();
    stream.synchronize();
    took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    why = peer.failure();
    timed_out = peer.timed_out();
    done = true;
  });
  EXPECT_TRUE(waited);
  EXPECT_LT(took, 5.0);
  EXPECT_FALSE(timed_out);
  EXPECT_NE(why.find("was aborted"), std::string::npos) << why;
}

namespace {

// Whether other processes may use cuda:0 beside this one.
bool shared_between_processes() {
  int mode = cudaComputeModeDefault;
  MPT_CUDA_CHECK(cudaDeviceGetAttribute(&mode, cudaDevAttrComputeMode, 0));
  return mode == cudaComputeModeDefault;
}

// Rank r's output; its own file for each test, since a test waits for
// lines in it (an earlier test's would be found at once).
std::string ipc_log(const std::string& mode, bool launch_after_kill, int r) {
  return fmt::format("/tmp/mpt-peer-ipc-{}-{}-{}-{}.log", mode, launch_after_kill ? "after" : "during", ::getpid(), r);
}

void remove_ipc_logs(const std::string& mode, bool launch_after_kill) {
  for (int r = 0; r < 2; ++r) std::remove(ipc_log(mode, launch_after_kill, r).c_str());
}

// Two ddp_worker processes in one of its peer_ipc modes, both on cuda:0.
std::vector<std::unique_ptr<mpt::testing::ChildProcess>> start_ipc_ranks(const std::string& mode, int timeout_s,
                                                                         bool launch_after_kill = false) {
  remove_ipc_logs(mode, launch_after_kill);
  return mpt::testing::start_worker_ranks(2, {mode}, timeout_s,
                                          {{"MPT_TEST_LAUNCH_AFTER_KILL", launch_after_kill ? "1" : "0"}},
                                          [&](int r) { return ipc_log(mode, launch_after_kill, r); });
}

// Rank 1 is killed after both mapped each other's memory; rank 0's kernel,
// launched before the kill or only after it (writing into the dead
// process's memory), must give up at the timeout, and rank 0 end with
// that reason rather than hang or fault.
void expect_a_killed_process_ends_its_peers_kernel(bool launch_after_kill) {
  const int timeout_s = 3;
  auto ranks = start_ipc_ranks("peer_ipc_killed", timeout_s, launch_after_kill);
  ASSERT_TRUE(ranks[1]->wait_for_output("rank 1: mapped", 60)) << ranks[1]->output() << ranks[0]->output();
  if (!launch_after_kill) {
    ASSERT_TRUE(ranks[0]->wait_for_output("rank 0: launched", 60)) << ranks[0]->output();
    std::this_thread::sleep_for(milliseconds(300));  // the kernel is waiting by now
  }
  ranks[1]->signal(SIGKILL);
  const auto killed_at = std::chrono::steady_clock::now();
  const auto status = ranks[0]->wait(timeout_s + 30);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  const std::string out = ranks[0]->output();
  remove_ipc_logs("peer_ipc_killed", launch_after_kill);
  std::cout << out;  // the survivor's message, for the report
  std::printf("rank 0 ended %.2f s after the kill (timeout %d s)\n", took, timeout_s);
  ASSERT_TRUE(status.has_value()) << "rank 0 still runs " << took << " s after rank 1 was killed:\n" << out;
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 3) << out;
  EXPECT_NE(out.find("rank 0 of 2 waited 3000 ms for another rank's GPU"), std::string::npos) << out;
  EXPECT_LT(took, timeout_s + 15);
}

}  // namespace

TEST(PeerAllReduce, TwoProcessesOnOneGpuSumAndAverageByTheRuleOverIpc) {
  MPT_SKIP_WITHOUT_CUDA();
  if (!shared_between_processes()) GTEST_SKIP() << "skipped: cuda:0 serves one process at a time (compute mode)";
  auto ranks = start_ipc_ranks("peer_ipc", 60);
  for (int r = 0; r < 2; ++r) {
    const auto status = ranks[r]->wait(180);
    const std::string out = ranks[r]->output();
    ASSERT_TRUE(status.has_value()) << "rank " << r << " still runs:\n" << out;
    EXPECT_FALSE(mpt::testing::exited_with_failure(*status)) << out;
    EXPECT_NE(out.find(fmt::format("rank {}: peer ipc ok", r)), std::string::npos) << out;
  }
  remove_ipc_logs("peer_ipc", false);
}

TEST(PeerAllReduce, AProcessKilledWhileItsPeerWaitsEndsThePeersKernelAtTheTimeout) {
  MPT_SKIP_WITHOUT_CUDA();
  if (!shared_between_processes()) GTEST_SKIP() << "skipped: cuda:0 serves one process at a time (compute mode)";
  expect_a_killed_process_ends_its_peers_kernel(false);
}

TEST(PeerAllReduce, AKernelLaunchedAfterItsPeerProcessDiedEndsAtTheTimeout) {
  MPT_SKIP_WITHOUT_CUDA();
  if (!shared_between_processes()) GTEST_SKIP() << "skipped: cuda:0 serves one process at a time (compute mode)";
  expect_a_killed_process_ends_its_peers_kernel(true);
}

#else

TEST(PeerAllReduce, TwoRanksOnOneGpuSumAndAverageByTheRule) { GTEST_SKIP() << "skipped: no CUDA device"; }

#endif
