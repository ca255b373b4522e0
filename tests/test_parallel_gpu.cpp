// The GPU side of data parallelism, on a machine with at least two GPUs
// (skipped elsewhere, but for the DDP steps that one GPU runs as a world of
// one): NCCL collectives against their written rules, DDP
// over NCCL through mpt-run against one process, DataParallel and
// ReplicaGroup over two GPUs against one, and a bounded failure when a peer
// never joins.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <thread>

#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "autograd/beside.h"
#include "autograd/engine.h"
#include "autograd/function.h"
#include "autograd/ops.h"
#include "models/adamw.h"
#include "models/sgd.h"
#include "parallel/data_parallel.h"
#include "parallel/distributed_data_parallel.h"
#include "parallel/distributed_error.h"
#include "parallel/bucket.h"
#include "parallel/child_process.h"
#include "parallel/launch.h"
#include "parallel/process_group.h"
#include "parallel/replica_group.h"
#include "parallel/thread_ranks.h"
#include "parallel/tiny_models.h"
#include "tensor/cuda/graph.h"
#include "tensor/device_guard.h"
#include "tensor/graph.h"
#include "test_util.h"

using namespace mpt;
using namespace mpt::dist;
using mpt::testing::flat_parameters;
using std::chrono::milliseconds;

#define SKIP_WITHOUT_TWO_GPUS()                                  \
  MPT_SKIP_WITHOUT_CUDA();                                       \
  if (cuda_device_count() < 2) GTEST_SKIP() << "skipped: fewer than 2 GPUs"

namespace {

// One thread per GPU, each a rank of an NCCL group.
void with_gpu_ranks(int world, const std::function<void(ProcessGroup&, const Device&)>& body,
                    Millis timeout = milliseconds(60000)) {
  mpt::testing::with_device_ranks(world, DeviceType::cuda, body, timeout);
}

std::vector<double> input_of(int rank, int n) {
  std::vector<double> v(n);
  for (int i = 0; i < n; ++i) v[i] = (rank + 1) * (i - 2) / 4.0;
  return v;
}

// A DDP training run on one GPU rank: make_mlp(seed), capturable AdamW
// (lr 1e-2), a loss scaler that grows every 3 clean steps.
struct ScaledDdpRun {
  std::shared_ptr<nn::Sequential> model;
  std::unique_ptr<DistributedDataParallel> ddp;
  std::unique_ptr<optim::AdamW> opt;
  amp::GradScaler scaler{amp::GradScalerOptions{.growth_interval = 3}};

  ScaledDdpRun(uint64_t seed, const Device& dev, const std::shared_ptr<ProcessGroup>& group, DdpOptions options = {})
      : model(mpt::testing::make_mlp(seed)) {
    model->to(dev);
    ddp = std::make_unique<DistributedDataParallel>(model, group, options);
    opt = std::make_unique<optim::AdamW>(model->parameters(), optim::AdamWOptions{.lr = 1e-2});
    opt->set_capturable(true);
  }

  void step(const Tensor& x, const Tensor& y) {
    opt->zero_grad();
    backward(scaler.scale(mse_loss(ddp->forward(x), y)));
    scaler.step(*opt);
    scaler.update();
  }
};

}  // namespace

// DDP's bucket fill on a GPU (one launch for many gradients) against the
// CPU's one-at-a-time rule, on fresh random gradients: 45 of them (more than
// one launch holds), sizes that span several chunks or are not a multiple of
// a 16-byte pack, slots at offsets that break 16-byte alignment, f16, and
// gradients cast on the way in and out (compressed transit).
TEST(DdpBucketFill, OneLaunchMatchesTheCpuForManyOddTensors) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = mpt::testing::fresh_seed();
  SCOPED_TRACE(seed);
  Generator gen(seed);
  const Device gpu(DeviceType::cuda, 0);
  const std::pair<DType, DType> kinds[] = {{DType::f32, DType::f32},  {DType::f16, DType::f16},
                                           {DType::f32, DType::f16},  {DType::f32, DType::bf16},
                                           {DType::f16, DType::f32},  {DType::bf16, DType::f32}};
  for (const auto& [grad_dtype, dtype] : kinds) {
    SCOPED_TRACE(fmt::format("{} gradients into {} slots", dtype_name(grad_dtype), dtype_name(dtype)));
    std::vector<int64_t> sizes;
    for (int i = 0; i < 45; ++i) sizes.push_back(i % 9 == 0 ? 200003 : 1 + 37 * i);
    int64_t total = 1;  // slot 0 starts one element in: misaligned
    for (int64_t n : sizes) total += n;
    const Tensor flat_cpu = zeros({total}, dtype, kCPU), flat_gpu = zeros({total}, dtype, gpu);
    std::vector<Tensor> slots_cpu, slots_gpu, grads_cpu, grads_gpu;
    int64_t offset = 1;
    for (int64_t n : sizes) {
      const Tensor g = prim::to(randn({n}, DType::f32, kCPU, &gen), grad_dtype);
      grads_cpu.push_back(g);
      grads_gpu.push_back(prim::to(g, gpu));
      slots_cpu.push_back(prim::slice(flat_cpu, 0, offset, offset + n));
      slots_gpu.push_back(prim::slice(flat_gpu, 0, offset, offset + n));
      offset += n;
    }
    prim::scaled_copy_list_(slots_cpu, grads_cpu, 1.0 / 3.0);
    prim::scaled_copy_list_(slots_gpu, grads_gpu, 1.0 / 3.0);
    EXPECT_EQ(prim::to(flat_gpu, kCPU).to_vector<float>(), flat_cpu.to_vector<float>());
  }
}

TEST(NcclProcessGroup, CollectivesFollowTheirRules) {
  SKIP_WITHOUT_TWO_GPUS();
  const int world = 2, n = 9;
  with_gpu_ranks(world, [&](ProcessGroup& g, const Device& dev) {
    EXPECT_EQ(g.backend_name(), "nccl");
    for (DType dtype : {DType::f32, DType::bf16}) {
      for (dist::ReduceOp op : {dist::ReduceOp::sum, dist::ReduceOp::avg, dist::ReduceOp::max}) {
        std::vector<double> expected(n, op == dist::ReduceOp::max ? -1e300 : 0.0);
        for (int r = 0; r < world; ++r)
          for (int i = 0; i < n; ++i)
            expected[i] = op == dist::ReduceOp::max ? std::max(expected[i], input_of(r, n)[i])
                                                    : expected[i] + input_of(r, n)[i];
        if (op == dist::ReduceOp::avg)
          for (auto& e : expected) e /= world;
        Tensor t = from_vector(input_of(g.rank(), n), {n}, dtype, dev);
        g.allreduce(t, op)->wait();
        EXPECT_LE(mpt::testing::max_abs_diff(t.to_vector<double>(), expected), 1e-2)
            << dtype_name(dtype) << " " << reduce_op_name(op);
      }
    }
    Tensor b = from_vector(input_of(g.rank(), 5), {5}, DType::f32, dev);
    g.broadcast(b, 1)->wait();
    EXPECT_EQ(b.to_vector<double>(), input_of(1, 5));

    std::vector<Tensor> outs = {zeros({4}, DType::f32, dev), zeros({4}, DType::f32, dev)};
    g.allgather(outs, from_vector(input_of(g.rank(), 4), {4}, DType::f32, dev))->wait();
    for (int r = 0; r < world; ++r) EXPECT_EQ(outs[r].to_vector<double>(), input_of(r, 4));

    Tensor in = from_vector(input_of(g.rank(), 4), {2, 2}, DType::f32, dev);
    Tensor out = zeros({1, 2}, DType::f32, dev);
    g.reduce_scatter(out, in)->wait();
    std::vector<double> expected(2, 0.0);
    for (int r = 0; r < world; ++r)
      for (int j = 0; j < 2; ++j) expected[j] += input_of(r, 4)[g.rank() * 2 + j];
    EXPECT_EQ(out.to_vector<double>(), expected);
    g.barrier()->wait();
  });
}

// A collective's Work dropped at once, with its output: the output's memory
// goes back to the caching allocator at once, and the next tensor of that
// size on the caller's stream gets it while the collective (behind a busy
// GPU) has not run. Filled on that stream, it must keep its values: the
// stream waits for the collective before the fill. (Without that wait the
// 256 MB copy of the all-gather and the fill run side by side.)
TEST(NcclProcessGroup, ADroppedWorkKeepsTheMemoryOfItsTensorsFromLaterKernels) {
  MPT_SKIP_WITHOUT_CUDA();
  with_gpu_ranks(1, [&](ProcessGroup& g, const Device& dev) {
    const int64_t n = int64_t(64) << 20;
    const Tensor input = full({n}, 7.0, DType::f32, dev);
    for (int round = 0; round < 5; ++round) {
      SCOPED_TRACE(round);
      mpt::testing::busy_gpu(dev);
      const void* freed = nullptr;
      {
        const Tensor out = Tensor::empty({n}, DType::f32, dev);
        freed = out.data_ptr();
        g.allgather({out}, input);
      }
      const Tensor later = full({n}, 3.0, DType::f32, dev);
      ASSERT_EQ(later.data_ptr(), freed) << "the freed block was not handed out again";
      EXPECT_EQ(prim::amin(later).item(), 3.0);
      EXPECT_EQ(prim::amax(later).item(), 3.0);
    }
  });
}

// A graph cannot wait for a collective launched outside its capture:
// before it (the work can still be waited for after the capture), or inside
// another capture. wait() says which, naming the collective.
TEST(NcclProcessGroup, WaitingInsideACaptureForACollectiveOutsideItIsRefusedClearly) {
  MPT_SKIP_WITHOUT_CUDA();
  with_gpu_ranks(1, [&](ProcessGroup& g, const Device& dev) {
    const Tensor t = full({16}, 2.0, DType::f32, dev);
    const auto expect_refused = [&](const WorkPtr& work, const std::string& where) {
      cuda::Graph graph(dev.index);
      try {
        graph.capture([&] { work->wait(); });
        ADD_FAILURE() << "wait() inside the capture did not throw";
      } catch (const ValueError& e) {
        mpt::testing::expect_contains(e.what(), {"allreduce(sum) of", where});
      }
    };
    const WorkPtr eager = g.allreduce(t, dist::ReduceOp::sum);
    expect_refused(eager, "before the capture began");
    eager->wait();
    EXPECT_EQ(t.to_vector<double>(), std::vector<double>(16, 2.0));

    // The second collective's wait joins NCCL's stream back into the
    // capture (after both), so the first capture ends with one unwaited.
    WorkPtr captured;
    cuda::Graph first(dev.index);
    first.capture([&] {
      captured = g.allreduce(t, dist::ReduceOp::sum);
      g.allreduce(t, dist::ReduceOp::sum)->wait();
    });
    expect_refused(captured, "inside another capture");
  });
}

// registered_buffer: NCCL memory in a symmetric window. Sums over the
// whole buffer and over one slice of it (the same offsets on both ranks,
// as symmetric windows require) follow the rule; another GPU is refused.
TEST(NcclProcessGroup, ARegisteredBufferServesCollectives) {
  SKIP_WITHOUT_TWO_GPUS();
  const int n = 3000;
  with_gpu_ranks(2, [&](ProcessGroup& g, const Device& dev) {
    Tensor buffer = g.registered_buffer(n, DType::f32, dev);
    ASSERT_TRUE(buffer.defined());
    EXPECT_EQ(buffer.device(), dev);
    EXPECT_EQ(buffer.numel(), n);
    prim::copy_(buffer, from_vector(input_of(g.rank(), n), {n}, DType::f32, dev));
    g.allreduce(buffer, dist::ReduceOp::sum)->wait();
    std::vector<double> expected(n);
    for (int i = 0; i < n; ++i) expected[i] = input_of(0, n)[i] + input_of(1, n)[i];
    EXPECT_EQ(buffer.to_vector<double>(), expected);

    Tensor part = prim::slice(buffer, 0, 1024, 2048);
    g.allreduce(part, dist::ReduceOp::sum)->wait();
    for (int i = 1024; i < 2048; ++i) expected[i] *= 2;
    EXPECT_EQ(buffer.to_vector<double>(), expected);

    const Device other(DeviceType::cuda, 1 - dev.index);
    EXPECT_THROW(g.registered_buffer(n, DType::f32, other), DeviceError);
  });
}

// With peer_collectives, registered_buffer is memory both GPUs map: its
// sums and averages run as the group's own kernel (f32, f16, bf16), its
// maximum and f64 through NCCL, all by the written rule.
TEST(NcclProcessGroup, APeerBufferServesCollectivesByTheRule) {
  SKIP_WITHOUT_TWO_GPUS();
  ProcessGroupOptions options;
  options.peer_collectives = true;
  const int n = 3001;
  mpt::testing::with_device_ranks(
      2, DeviceType::cuda,
      [&](ProcessGroup& g, const Device& dev) {
        for (DType d : {DType::f32, DType::f16, DType::bf16, DType::f64}) {
          SCOPED_TRACE(dtype_name(d));
          Tensor buffer = g.registered_buffer(n, d, dev);
          ASSERT_TRUE(buffer.defined());
          // Small integers: every value and sum is exact in each dtype.
          auto input = [&](int rank) {
            std::vector<double> v(n);
            for (int i = 0; i < n; ++i) v[i] = (rank + 1) * (i % 64 - 8);
            return v;
          };
          prim::copy_(buffer, from_vector(input(g.rank()), {n}, d, dev));
          g.allreduce(buffer, dist::ReduceOp::sum)->wait();
          std::vector<double> expected(n);
          for (int i = 0; i < n; ++i) expected[i] = input(0)[i] + input(1)[i];
          EXPECT_EQ(buffer.to_vector<double>(), expected);
          Tensor part = prim::slice(buffer, 0, 1000, 2001);
          g.allreduce(part, dist::ReduceOp::avg)->wait();
          EXPECT_EQ(buffer.to_vector<double>(), expected);  // the average of equal values
          prim::fill_(part, g.rank());
          g.allreduce(part, dist::ReduceOp::max)->wait();
          for (int i = 1000; i < 2001; ++i) expected[i] = 1;
          EXPECT_EQ(buffer.to_vector<double>(), expected);
        }
      },
      milliseconds(60000), options);
}

// DDP with its buckets in registered memory (NCCL's symmetric kernels, or
// with peer_collectives the group's own kernel) averages exactly as with
// ordinary buffers: two ranks' halves summed in either order give the same
// f32. Several buckets, rebuilt after the first step; the registered bytes
// are reported.
namespace {

void expect_registered_buckets_average_like_ordinary_ones(bool peer_collectives) {
  const uint64_t seed = mpt::testing::fresh_seed();
  SCOPED_TRACE(seed);
  ProcessGroupOptions group_options;
  group_options.peer_collectives = peer_collectives;
  mpt::testing::with_device_ranks(2, DeviceType::cuda, [&](ProcessGroup& g, const Device& dev) {
    DeviceGuard on_device(dev);
    const std::shared_ptr<ProcessGroup> group(&g, [](ProcessGroup*) {});  // owned by with_device_ranks
    auto ordinary_model = mpt::testing::make_mlp(seed), registered_model = mpt::testing::make_mlp(seed);
    ordinary_model->to(dev);
    registered_model->to(dev);
    const DdpOptions small_buckets{.first_bucket_bytes = 200, .bucket_bytes = 600};
    DdpOptions registered = small_buckets;
    registered.registered_buffers = true;
    DistributedDataParallel ordinary(ordinary_model, group, small_buckets), in_window(registered_model, group, registered);
    EXPECT_EQ(ordinary.registered_bytes(), 0);
    EXPECT_GT(in_window.registered_bytes(), 0);
    Generator gen(seed + 1 + g.rank());
    for (int step = 0; step < 3; ++step) {
      const Tensor x = prim::to(randn({8, 6}, DType::f32, kCPU, &gen), dev);
      const Tensor y = prim::to(randn({8, 3}, DType::f32, kCPU, &gen), dev);
      ordinary_model->zero_grad();
      registered_model->zero_grad();
      backward(mse_loss(ordinary(x), y));
      backward(mse_loss(in_window(x), y));
      const auto a = ordinary_model->parameters(), b = registered_model->parameters();
      for (size_t i = 0; i < a.size(); ++i)
        EXPECT_EQ(a[i].grad().to_vector<float>(), b[i].grad().to_vector<float>()) << "step " << step << ", parameter " << i;
    }
    EXPECT_TRUE(in_window.buckets_rebuilt());
  }, milliseconds(60000), group_options);
}

}  // namespace

TEST(NcclDdp, RegisteredBucketBuffersAverageLikeOrdinaryOnes) {
  SKIP_WITHOUT_TWO_GPUS();
  expect_registered_buckets_average_like_ordinary_ones(false);
}

TEST(NcclDdp, PeerCollectiveBucketsAverageLikeOrdinaryOnes) {
  SKIP_WITHOUT_TWO_GPUS();
  expect_registered_buckets_average_like_ordinary_ones(true);
}

// Two ranks on one GPU: NCCL itself would only say "invalid usage". Both
// ranks refuse, naming the pair and the GPU.
TEST(NcclProcessGroup, TwoRanksOnOneGpuAreRefusedNamingThem) {
  MPT_SKIP_WITHOUT_CUDA();
  const auto stores = dist::loopback_stores(2, milliseconds(20000));
  std::vector<std::string> messages(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      try {
        dist::new_process_group(stores[r], r, 2, DeviceType::cuda, {}, /*device=*/0);
      } catch (const DeviceError& e) {
        messages[r] = e.what();
      }
    });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(messages[r].find(fmt::format(
                  "NCCL group (rank {} of 2): ranks 0 (cuda:0 there) and 1 (cuda:0 there) both drive the GPU at", r)),
              std::string::npos)
        << messages[r];
    EXPECT_NE(messages[r].find("; each rank needs a GPU of its own"), std::string::npos) << messages[r];
  }
}

TEST(NcclProcessGroup, APeerThatNeverCallsTimesOut) {
  SKIP_WITHOUT_TWO_GPUS();
  std::string message;
  std::atomic<bool> done{false};
  const auto start = std::chrono::steady_clock::now();
  with_gpu_ranks(
      2,
      [&](ProcessGroup& g, const Device& dev) {
        if (g.rank() == 1) {
          while (!done) std::this_thread::sleep_for(milliseconds(5));
          return;
        }
        try {
          g.allreduce(ones({8}, DType::f32, dev))->wait();
        } catch (const TimeoutError& e) {
          message = e.what();
        }
        done = true;
      },
      milliseconds(3000));
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(message.find("allreduce(sum)"), std::string::npos) << message;
  EXPECT_NE(message.find("timeout 3000 ms"), std::string::npos) << message;
  EXPECT_LT(took, 30.0);
}

// A collective recorded into a CUDA graph has no host call to time out at
// replay: the group's watchdog bounds every replay instead. Rank 1 stops
// replaying; rank 0's next replay waits on the GPU for it until the
// watchdog aborts the communicator, which ends the waiting kernel (so the
// host's synchronization returns), and the replay after says why.
TEST(NcclProcessGroup, AReplayedCollectiveWhosePeerStopsEndsWithinTheTimeout) {
  SKIP_WITHOUT_TWO_GPUS();
  std::string message;
  double waited_s = -1;
  std::atomic<bool> done{false};
  with_gpu_ranks(
      2,
      [&](ProcessGroup& g, const Device& dev) {
        DeviceGuard on_device(dev);
        Tensor t = full({1024}, 1.0, DType::f32, dev);
        CapturedStep captured(
            dev, [&](const std::vector<Tensor>&) { g.allreduce(t, dist::ReduceOp::avg)->wait(); }, 1);
        for (int i = 0; i < 4; ++i) captured.run();
        EXPECT_EQ(captured.replays(), 3);
        EXPECT_EQ(t.to_vector<double>(), std::vector<double>(1024, 1.0));
        if (g.rank() == 1) {
          while (!done) std::this_thread::sleep_for(milliseconds(5));
          return;
        }
        const auto start = std::chrono::steady_clock::now();
        captured.run();  // rank 1 never joins this one
        try {
          (void)t.to_vector<double>();  // returns once the watchdog has aborted the communicator
        } catch (const Error&) {
        }
        waited_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        try {
          captured.run();
        } catch (const DistributedError& e) {
          message = e.what();
        }
        done = true;
      },
      milliseconds(3000));
  std::printf("rank 0's hung replay ended after %.2f s (timeout 3 s)\n", waited_s);
  EXPECT_NE(message.find("replayed in a CUDA graph on rank 0 of 2"), std::string::npos) << message;
  EXPECT_NE(message.find("timeout 3000 ms"), std::string::npos) << message;
  EXPECT_NE(message.find("communicator aborted"), std::string::npos) << message;
  EXPECT_GE(waited_s, 2.9);
  EXPECT_LT(waited_s, 30.0);
}

namespace {

// Two ranks started directly (nobody stops the survivor for it), DDP over
// NCCL; rank 1 is killed mid-training. Rank 0 must notice through NCCL's
// asynchronous error or its timeout, abort the communicator and fail, not
// hang: with eager steps, and with steps replayed as CUDA graphs, whose
// collectives only the replay watchdog sees.
void expect_killed_rank_ends_the_other(const std::string& mode, bool peer_collectives = false) {
  const int timeout_s = 20;
  auto ranks = mpt::testing::start_worker_ranks(
      2, {mode, "cuda"}, timeout_s, {{"MPT_TEST_PEER_COLLECTIVES", peer_collectives ? "1" : "0"}},
      [&](int r) { return fmt::format("/tmp/mpt-nccl-kill-{}-{}-{}.log", mode, ::getpid(), r); });
  ASSERT_TRUE(ranks[1]->wait_for_output("rank 1: step 30", 120)) << ranks[1]->output() << ranks[0]->output();
  ranks[1]->signal(SIGKILL);
  const auto killed_at = std::chrono::steady_clock::now();
  const auto status = ranks[0]->wait(timeout_s + 10);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  const std::string out = ranks[0]->output();
  for (int r = 0; r < 2; ++r) std::remove(fmt::format("/tmp/mpt-nccl-kill-{}-{}-{}.log", mode, ::getpid(), r).c_str());
  std::cout << out;  // the survivor's message, for the report
  std::printf("%s: faults injected: 1, rank 0 ended %.2f s after the kill (timeout %d s)\n", mode.c_str(), took,
              timeout_s);
  ASSERT_TRUE(status.has_value()) << "rank 0 still runs " << took << " s after rank 1 was killed:\n" << out;
  EXPECT_TRUE(mpt::testing::exited_with_failure(*status)) << out;
  EXPECT_NE(out.find("NCCL"), std::string::npos) << out;
  EXPECT_NE(out.find("communicator aborted"), std::string::npos) << out;
  EXPECT_LT(took, timeout_s + 5);
}

}  // namespace

TEST(NcclDdp, AKilledRankEndsTheOtherWithAnAbortedCommunicator) {
  SKIP_WITHOUT_TWO_GPUS();
  expect_killed_rank_ends_the_other("train");
}

TEST(NcclDdp, AKilledRankEndsTheOtherWhenStepsAreReplayedGraphs) {
  SKIP_WITHOUT_TWO_GPUS();
  expect_killed_rank_ends_the_other("train_graphed");
}

// The group's own all-reduce kernel between two processes (CUDA IPC): a
// killed rank ends the survivor's replays within the timeout too, where
// NCCL's symmetric kernels kept it waiting.
TEST(NcclDdp, AKilledRankEndsTheOtherWhenGraphedStepsUsePeerCollectives) {
  SKIP_WITHOUT_TWO_GPUS();
  expect_killed_rank_ends_the_other("train_graphed", true);
}

TEST(NcclDdp, TwoGpusMatchOneProcess) {
  SKIP_WITHOUT_TWO_GPUS();
  for (const char* mode : {"plain cuda", "accum cuda", "compress cuda"}) {
    const auto r = mpt::testing::run_job(mode);
    EXPECT_EQ(r.exit_code, 0) << mode << "\n" << r.output;
    std::cout << r.output;  // the measured errors, for the report
  }
  // Buckets all-reduced by the group's own kernel, across processes.
  for (const char* mode : {"plain cuda", "compress cuda"}) {
    const auto r = mpt::testing::run_job(mode, 2, "MPT_TEST_PEER_COLLECTIVES=1");
    EXPECT_EQ(r.exit_code, 0) << mode << " (peer collectives)\n" << r.output;
    EXPECT_NE(r.output.find("peer collectives"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("no peer collectives"), std::string::npos) << r.output;
    std::cout << r.output;
  }
}

// A whole DDP step (forward, backward with its bucket all-reduces, the
// scaler's found_inf all-reduce, AdamW) recorded as a CUDA graph and
// replayed trains exactly as the same steps run eagerly, and leaves both
// ranks with the same parameters. One GPU runs it as a world of one.
// `peer_collectives`: the graphed run's buckets in the group's peer memory,
// all-reduced by its own kernel inside the graph.
namespace {

void expect_captured_ddp_steps_match_eager_ones(bool peer_collectives) {
  const uint64_t seed = mpt::testing::fresh_seed();
  SCOPED_TRACE(seed);
  const int steps = 8, world = std::min(2, cuda_device_count());
  ProcessGroupOptions group_options;
  group_options.peer_collectives = peer_collectives;
  mpt::testing::with_device_ranks(world, DeviceType::cuda, [&](ProcessGroup& g, const Device& dev) {
    DeviceGuard on_device(dev);
    const std::shared_ptr<ProcessGroup> group(&g, [](ProcessGroup*) {});  // owned by with_device_ranks
    Generator data(seed + 1 + g.rank());                                   // each rank its own batches
    std::vector<Tensor> xs, ys;
    for (int s = 0; s < steps; ++s) {
      xs.push_back(prim::to(randn({8, 6}, DType::f32, kCPU, &data), dev));
      ys.push_back(prim::to(randn({8, 3}, DType::f32, kCPU, &data), dev));
    }
    ScaledDdpRun eager(seed, dev, group), graphed(seed, dev, group, {.registered_buffers = peer_collectives});
    EXPECT_EQ(graphed.ddp->registered_bytes() > 0, peer_collectives);
    for (ScaledDdpRun* r : {&eager, &graphed}) {
      DistributedDataParallel* ddp = r->ddp.get();
      r->scaler.set_found_inf_reducer([ddp](Tensor& found_inf) { ddp->allreduce_found_inf(found_inf); });
    }
    CapturedStep captured(dev, [&](const std::vector<Tensor>& in) { graphed.step(in[0], in[1]); });
    for (int s = 0; s < steps; ++s) {
      eager.step(xs[s], ys[s]);
      captured.run({xs[s], ys[s]});
    }
    EXPECT_TRUE(captured.fallback_reason().empty()) << captured.fallback_reason();
    EXPECT_GE(captured.replays(), 4);
    EXPECT_EQ(graphed.scaler.get_scale(), eager.scaler.get_scale());
    EXPECT_LE(mpt::testing::rel_error(flat_parameters(*graphed.model), flat_parameters(*eager.model)), 1e-6)
        << "rank " << g.rank();
    // Both ranks hold the same parameters: their mean is each one's own.
    for (auto& p : graphed.model->parameters()) {
      Tensor mean = prim::clone(p);
      g.allreduce(mean, dist::ReduceOp::avg)->wait();
      EXPECT_EQ(mean.to_vector<double>(), p.to_vector<double>()) << "rank " << g.rank();
    }
  }, milliseconds(60000), group_options);
}

}  // namespace

TEST(NcclDdp, AStepCapturedAsACudaGraphMatchesEagerSteps) {
  MPT_SKIP_WITHOUT_CUDA();
  expect_captured_ddp_steps_match_eager_ones(false);
}

// The same with the graphed run's buckets all-reduced by the group's own
// kernel (one GPU: a world of one, whose kernel still runs its meetings).
TEST(NcclDdp, AStepWithPeerCollectivesCapturedAsACudaGraphMatchesEagerSteps) {
  MPT_SKIP_WITHOUT_CUDA();
  expect_captured_ddp_steps_match_eager_ones(true);
}

// overlap_step_with on the GPU: the last bucket's flags all-reduced ahead
// of it, its all-reduce beside the step of the other parameters, the whole
// step captured as a CUDA graph. It trains as eager steps that wait for the
// whole backward, through a step whose input holds an inf on rank 0 (every
// rank skips it). One GPU runs it as a world of one.
TEST(NcclDdp, AnOverlappedStepCapturedAsACudaGraphMatchesPlainEagerSteps) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = mpt::testing::fresh_seed();
  SCOPED_TRACE(seed);
  const int steps = 10, world = std::min(2, cuda_device_count());
  with_gpu_ranks(world, [&](ProcessGroup& g, const Device& dev) {
    DeviceGuard on_device(dev);
    const std::shared_ptr<ProcessGroup> group(&g, [](ProcessGroup*) {});  // owned by with_gpu_ranks
    Generator data(seed + 1 + g.rank());
    std::vector<Tensor> xs, ys;
    for (int s = 0; s < steps; ++s) {
      Tensor x = randn({8, 6}, DType::f32, kCPU, &data);
      if (s == 6 && g.rank() == 0) prim::fill_(prim::slice(prim::reshape(x, {48}), 0, 5, 6), INFINITY);
      xs.push_back(prim::to(x, dev));
      ys.push_back(prim::to(randn({8, 3}, DType::f32, kCPU, &data), dev));
    }
    const DdpOptions small_buckets{.first_bucket_bytes = 200, .bucket_bytes = 600};
    ScaledDdpRun eager(seed, dev, group, small_buckets), graphed(seed, dev, group, small_buckets);
    graphed.ddp->overlap_step_with(graphed.scaler);
    CapturedStep captured(dev, [&](const std::vector<Tensor>& in) { graphed.step(in[0], in[1]); });
    std::vector<double> eager_scales, graphed_scales;
    for (int s = 0; s < steps; ++s) {
      eager.step(xs[s], ys[s]);
      captured.run({xs[s], ys[s]});
      eager_scales.push_back(eager.scaler.get_scale());
      graphed_scales.push_back(graphed.scaler.get_scale());
    }
    EXPECT_TRUE(captured.fallback_reason().empty()) << captured.fallback_reason();
    EXPECT_GE(captured.replays(), 6);
    EXPECT_EQ(graphed_scales, eager_scales);
    EXPECT_EQ(eager_scales[6], eager_scales[5] / 2);  // the inf's step was skipped
    EXPECT_EQ(graphed.opt->step_count(0), steps - 1);
    EXPECT_LE(mpt::testing::rel_error(flat_parameters(*graphed.model), flat_parameters(*eager.model)), 1e-6)
        << "rank " << g.rank();
  });
}

namespace {

// A DDP training run on one GPU rank: given the rank's group and device,
// generators for the weights (the same on every rank) and the data (the
// rank's own), trains and returns every parameter's gradient on the host.
using DdpRunOnRank = std::function<std::vector<std::vector<double>>(
    const std::shared_ptr<ProcessGroup>&, const Device&, Generator& init, Generator& data)>;

// Runs `run` on every GPU rank (one GPU: a world of one) with every gradient
// made in order, then with weight gradients beside the chain (the default),
// and expects the same bits of every gradient.
void expect_gradients_beside_the_chain_as_in_order(uint64_t seed, const DdpRunOnRank& run) {
  const int world = std::min(2, cuda_device_count());
  std::vector<std::vector<std::vector<double>>> grads[2];  // [beside][rank][parameter]
  for (bool overlap : {false, true}) {
    beside::set_enabled(overlap);
    grads[overlap].assign(world, {});
    with_gpu_ranks(world, [&](ProcessGroup& g, const Device& dev) {
      DeviceGuard on_device(dev);
      const std::shared_ptr<ProcessGroup> group(&g, [](ProcessGroup*) {});  // owned by with_gpu_ranks
      Generator init(seed), data(seed + 1 + g.rank());
      grads[overlap][g.rank()] = run(group, dev, init, data);
    });
  }
  beside::set_enabled(true);
  for (int r = 0; r < world; ++r)
    for (size_t i = 0; i < grads[0][r].size(); ++i)
      EXPECT_EQ(grads[1][r][i], grads[0][r][i]) << "rank " << r << ", parameter " << i;
}

std::vector<std::vector<double>> host_gradients(nn::Module& model) {
  std::vector<std::vector<double>> grads;
  for (const Tensor& p : model.parameters()) grads.push_back(p.grad().to_vector<double>());
  return grads;
}

// Identity whose backward rule first queues about a millisecond of work on
// backward's side stream: side work issued after it (a weight gradient, the
// sink that sums it up) ends that much later, so a reader off the side
// stream that does not wait for it reads the gradient before it is complete.
class DelaysTheSideStream : public nn::Module {
 public:
  DelaysTheSideStream() : Module("DelaysTheSideStream") {}
  Tensor forward(const Tensor& x) override {
    Tensor y = prim::mul_scalar(x, 1.0);
    const Device device = x.device();
    record("delays_the_side_stream", y, {x}, [device](const Grads& g) {
      beside::run(device, {}, [&] {
        mpt::testing::busy_gpu(device);
        return std::vector<Tensor>{};
      });
      return Grads{g[0]};
    });
    return y;
  }
};

}  // namespace

// DDP over layers whose weight gradients are large enough to run beside
// backward's chain of input gradients (autograd/beside.h): the sinks and
// DDP's hooks follow them onto the side stream, and each bucket's fill and
// all-reduce go where all of its gradients are complete. The averaged
// gradients are the same bits as with every gradient made in order, over
// two iterations (buckets made again) with buckets averaged in place (the
// 4 MiB weights) and filled (the biases). One GPU runs it as a world of one.
TEST(NcclDdp, WeightGradientsBesideTheChainAverageLikeOrderedOnes) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = mpt::testing::fresh_seed();
  SCOPED_TRACE(seed);
  expect_gradients_beside_the_chain_as_in_order(seed, [](const std::shared_ptr<ProcessGroup>& group,
                                                         const Device& dev, Generator& init, Generator& data) {
    auto model = std::make_shared<nn::Sequential>();
    for (int64_t out : {1024, 1024, 10}) {  // weight gradients of 2^30 multiply-adds, then a small one
      model->push_back(std::make_shared<nn::Linear>(1024, out, true, &init));
      if (out != 10) model->push_back(std::make_shared<nn::ReLU>());
    }
    model->to(dev);
    DistributedDataParallel ddp(model, group, {.bucket_bytes = size_t(1) << 20});
    for (int iteration = 0; iteration < 2; ++iteration) {
      model->zero_grad();
      const Tensor x = prim::to(randn({1024, 1024}, DType::f32, kCPU, &data), dev);
      const Tensor y = prim::to(randn({1024, 10}, DType::f32, kCPU, &data), dev);
      Tensor out;
      {
        amp::AutocastGuard autocast(DeviceType::cuda, DType::f16);
        out = ddp.forward(x);
      }
      backward(mse_loss(to(out, DType::f32), y));
    }
    return host_gradients(*model);
  });
}

// One bucket mixes a large weight, whose gradient is made beside the chain
// (its sink runs there too), with a small first layer's parameters, made on
// the chain last, so that a hook off the side stream completes the bucket.
// The fill must wait for the side stream in two cases: when the large
// weight's sink adds into a gradient accumulated under no_sync (the sum is
// a tensor the side stream wrote in place), and when forward ran on a
// stream of its own and backward is called from another (the small layer's
// sinks run on the caller's stream, neither the pass's chain nor its side
// stream). Averaged gradients: the same bits as in order.
TEST(NcclDdp, BucketsCompletedOffTheSideStreamWaitForIt) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = mpt::testing::fresh_seed();
  SCOPED_TRACE(seed);
  for (const bool accumulate : {true, false}) {
    SCOPED_TRACE(accumulate ? "accumulated under no_sync" : "forward on a stream of its own");
    expect_gradients_beside_the_chain_as_in_order(seed, [accumulate](const std::shared_ptr<ProcessGroup>& group,
                                                                     const Device& dev, Generator& init,
                                                                     Generator& data) {
      // Weight gradients of 2^27, 2^32 and 2^24 multiply-adds: only the
      // middle one beside; 17 MB of f32 gradients, one bucket.
      auto model = std::make_shared<nn::Sequential>();
      model->push_back(std::make_shared<nn::Linear>(64, 2048, true, &init));
      model->push_back(std::make_shared<nn::ReLU>());
      model->push_back(std::make_shared<nn::Linear>(2048, 2048, true, &init));
      model->push_back(std::make_shared<nn::ReLU>());
      model->push_back(std::make_shared<DelaysTheSideStream>());
      model->push_back(std::make_shared<nn::Linear>(2048, 8, true, &init));
      model->to(dev);
      DistributedDataParallel ddp(model, group);
      const Stream forward_stream = Stream::create(dev);
      auto micro_batch = [&] {
        const Tensor x = prim::to(randn({1024, 64}, DType::f32, kCPU, &data), dev);
        const Tensor y = prim::to(randn({1024, 8}, DType::f32, kCPU, &data), dev);
        Tensor loss;
        {
          std::optional<StreamGuard> on_forward_stream;
          if (!accumulate) {
            Event inputs_made(dev);
            inputs_made.record();
            inputs_made.wait(forward_stream);
            on_forward_stream.emplace(forward_stream);
          }
          amp::AutocastGuard autocast(DeviceType::cuda, DType::f16);
          loss = mse_loss(to(ddp.forward(x), DType::f32), y);
        }
        backward(loss);
      };
      for (int iteration = 0; iteration < 2; ++iteration) {
        model->zero_grad();
        if (accumulate) {
          const auto no_sync = ddp.no_sync();
          micro_batch();
        }
        micro_batch();
      }
      return host_gradients(*model);
    });
  }
}

TEST(DataParallelGpu, TwoGpusTrainLikeOne) {
  SKIP_WITHOUT_TWO_GPUS();
  const uint64_t seed = mpt::testing::fresh_seed();
  SCOPED_TRACE(seed);
  const Device d0("cuda:0"), d1("cuda:1");
  Generator data(seed);
  const int64_t batch = 16;
  const Tensor X = randn({3 * batch, 6}, DType::f32, kCPU, &data);
  const Tensor Y = randn({3 * batch, 3}, DType::f32, kCPU, &data);
  auto loss = [](const Tensor& out, const Tensor& y) { return mse_loss(out, y); };

  auto model = mpt::testing::make_mlp(seed);
  model->to(d0);
  DataParallel dp(model, [&] { return mpt::testing::make_mlp(seed + 1); }, {d0, d1});
  optim::SGD opt(model->parameters(), {.lr = 0.1, .momentum = 0.9});
  auto reference = mpt::testing::make_mlp(seed);
  reference->to(d0);
  optim::SGD ref_opt(reference->parameters(), {.lr = 0.1, .momentum = 0.9});
  for (int s = 0; s < 3; ++s) {
    const Tensor x = prim::slice(X, 0, s * batch, (s + 1) * batch);
    const Tensor y = prim::slice(Y, 0, s * batch, (s + 1) * batch);
    opt.zero_grad();
    dp.forward_backward(x, y, loss);
    opt.step();
    ref_opt.zero_grad();
    backward(mse_loss(reference->forward(prim::to(x, d0)), prim::to(y, d0)));
    ref_opt.step();
  }
  EXPECT_LE(mpt::testing::rel_error(flat_parameters(*model), flat_parameters(*reference)), 1e-5);
}

// ReplicaGroup over two GPUs, each replica's whole step (its share of the
// batch copied from cuda:0, forward, backward with the bucket all-reduces,
// its scaler, capturable AdamW) captured as a CUDA graph by its own thread:
// the replicas train as one GPU does on the whole batch, eagerly, and stay
// bit-identical.
namespace {

void expect_graphed_replicas_train_like_one_gpu(bool peer_collectives) {
  const uint64_t seed = mpt::testing::fresh_seed();
  SCOPED_TRACE(seed);
  const Device d0("cuda:0"), d1("cuda:1");
  const int steps = 8;
  const int64_t batch = 16;
  Generator data(seed);
  std::vector<Tensor> xs, ys;  // whole batches on cuda:0
  for (int s = 0; s < steps; ++s) {
    xs.push_back(prim::to(randn({batch, 6}, DType::f32, kCPU, &data), d0));
    ys.push_back(prim::to(randn({batch, 3}, DType::f32, kCPU, &data), d0));
  }
  const amp::GradScalerOptions so{.init_scale = 1024, .growth_interval = 3};
  const optim::AdamWOptions ao{.lr = 1e-2};

  auto model = mpt::testing::make_mlp(seed);
  model->to(d0);
  ReplicaGroupOptions options;
  options.timeout = milliseconds(30000);  // a failing replica ends the test in bounded time
  options.peer_collectives = peer_collectives;
  options.ddp.registered_buffers = peer_collectives;
  ReplicaGroup group(model, [&] { return mpt::testing::make_mlp(seed + 1); }, {d0, d1}, options);
  std::vector<double> scales(2);
  std::vector<int64_t> replays(2);
  std::vector<std::string> fallbacks(2);
  group.run([&](Replica& r) {
    optim::AdamW opt(r.module->parameters(), ao);
    opt.set_capturable(true);
    amp::GradScaler scaler(so);
    CapturedStep step(r.device, [&](const std::vector<Tensor>& in) {
      opt.zero_grad();
      backward(scaler.scale(mse_loss(r.ddp->forward(in[0]), in[1])));
      scaler.step(opt);
      scaler.update();
    });
    const int64_t rows = batch / 2, begin = static_cast<int64_t>(r.rank) * rows;
    for (int s = 0; s < steps; ++s)
      step.run({prim::slice(xs[s], 0, begin, begin + rows), prim::slice(ys[s], 0, begin, begin + rows)});
    scales[r.rank] = scaler.get_scale();
    replays[r.rank] = step.replays();
    fallbacks[r.rank] = step.fallback_reason();
  });

  auto reference = mpt::testing::make_mlp(seed);
  reference->to(d0);
  optim::AdamW ref_opt(reference->parameters(), ao);
  amp::GradScaler ref_scaler(so);
  for (int s = 0; s < steps; ++s) {
    ref_opt.zero_grad();
    backward(ref_scaler.scale(mse_loss(reference->forward(xs[s]), ys[s])));
    ref_scaler.step(ref_opt);
    ref_scaler.update();
  }
  const std::vector<double> expected = flat_parameters(*reference);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_TRUE(fallbacks[r].empty()) << "replica " << r << ": " << fallbacks[r];
    EXPECT_GE(replays[r], 4) << "replica " << r;
    EXPECT_EQ(scales[r], ref_scaler.get_scale()) << "replica " << r;
    EXPECT_LE(mpt::testing::rel_error(flat_parameters(*group.replica(r).module), expected), 1e-5) << "replica " << r;
  }
  EXPECT_EQ(flat_parameters(*group.replica(1).module), flat_parameters(*group.replica(0).module));
  EXPECT_EQ(group.replica(0).ddp->registered_bytes() > 0, peer_collectives);
}

}  // namespace

TEST(ReplicaGroupGpu, GraphedStepsOnTwoGpusTrainLikeOneGpu) {
  SKIP_WITHOUT_TWO_GPUS();
  expect_graphed_replicas_train_like_one_gpu(false);
}

// The same with the buckets all-reduced by the groups' own kernel (the
// replicas' threads share device pointers, with peer access between the GPUs).
TEST(ReplicaGroupGpu, GraphedStepsWithPeerCollectivesTrainLikeOneGpu) {
  SKIP_WITHOUT_TWO_GPUS();
  expect_graphed_replicas_train_like_one_gpu(true);
}

TEST(DataParallelGpu, AModuleLeftOnTheCpuIsAClearError) {
  MPT_SKIP_WITHOUT_CUDA();
  auto model = mpt::testing::make_mlp(1);
  try {
    DataParallel dp(model, [] { return mpt::testing::make_mlp(1); }, {Device("cuda:0")});
    FAIL() << "expected a DeviceError";
  } catch (const DeviceError& e) {
    EXPECT_NE(std::string(e.what()).find("must live on devices[0] = cuda:0"), std::string::npos) << e.what();
  }
}
