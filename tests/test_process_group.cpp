// The Gloo process group, with ranks as threads of one process over a real
// TcpStore and real TCP connections. Expected values come from the written
// rule of each collective, computed here from every rank's inputs.
#include <atomic>
#include <chrono>
#include <functional>
#include <thread>

#include "autograd/ops.h"
#include "parallel/bucket.h"
#include "parallel/device_routed_group.h"
#include "parallel/distributed_error.h"
#include "parallel/process_group.h"
#include "parallel/tcp_store.h"
#include "parallel/free_port.h"
#include "parallel/thread_ranks.h"
#include "test_util.h"

using namespace mpt;
using namespace mpt::dist;
using std::chrono::milliseconds;
using mpt::testing::with_ranks;

namespace {

// Rank r's input: element i is (r + 1) * (i - 2) / 4, exact in every float type.
std::vector<double> input_of(int rank, int n) {
  std::vector<double> v(n);
  for (int i = 0; i < n; ++i) v[i] = (rank + 1) * (i - 2) / 4.0;
  return v;
}

Tensor tensor_of(const std::vector<double>& v, DType dtype) {
  return from_vector(v, {static_cast<int64_t>(v.size())}, dtype);
}

}  // namespace

TEST(GlooProcessGroup, AllreduceSumAvgMaxInEveryDType) {
  const int world = 3, n = 7;
  with_ranks(world, [&](ProcessGroup& g) {
    EXPECT_EQ(g.backend_name(), "gloo");
    for (DType dtype : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i64, DType::i32}) {
      for (dist::ReduceOp op : {dist::ReduceOp::sum, dist::ReduceOp::avg, dist::ReduceOp::max}) {
        if (op == dist::ReduceOp::avg && !is_floating(dtype)) continue;
        std::vector<double> expected(n, op == dist::ReduceOp::max ? -1e300 : 0.0);
        for (int r = 0; r < world; ++r) {
          const auto in = input_of(r, n);
          for (int i = 0; i < n; ++i)
            expected[i] = op == dist::ReduceOp::max ? std::max(expected[i], in[i]) : expected[i] + in[i];
        }
        if (op == dist::ReduceOp::avg)
          for (auto& e : expected) e /= world;
        std::vector<double> mine = input_of(g.rank(), n);
        if (!is_floating(dtype))
          for (auto& x : mine) x = std::trunc(x * 4);  // integers: keep it exact
        if (!is_floating(dtype))
          for (int i = 0; i < n; ++i) {
            expected[i] = op == dist::ReduceOp::max ? -1e300 : 0;
            for (int r = 0; r < world; ++r) {
              const double x = std::trunc(input_of(r, n)[i] * 4);
              expected[i] = op == dist::ReduceOp::max ? std::max(expected[i], x) : expected[i] + x;
            }
          }
        Tensor t = tensor_of(mine, dtype);
        g.allreduce(t, op)->wait();
        // avg divides each rank's value before the sum: a rounding in the
        // tensor's dtype before each addition.
        const double tol = dtype == DType::f16 || dtype == DType::bf16 ? 2e-2 : dtype == DType::f32 ? 1e-6 : 1e-12;
        EXPECT_LE(mpt::testing::max_abs_diff(t.to_vector<double>(), expected), tol)
            << dtype_name(dtype) << " " << reduce_op_name(op) << " rank " << g.rank();
      }
    }
  });
}

// The average divides before it sums (as NCCL's does for floats), so the
// average of values near the top of f32's range stays finite.
TEST(GlooProcessGroup, AnAverageOfFiniteValuesIsFinite) {
  with_ranks(2, [&](ProcessGroup& g) {
    Tensor t = full({3}, 3e38);
    g.allreduce(t, dist::ReduceOp::avg)->wait();
    for (float v : t.to_vector<float>()) EXPECT_FLOAT_EQ(v, 3e38f);
  });
}

TEST(GlooProcessGroup, BroadcastAllgatherReduceScatterBarrier) {
  const int world = 3;
  with_ranks(world, [&](ProcessGroup& g) {
    Tensor b = tensor_of(input_of(g.rank(), 5), DType::f32);
    g.broadcast(b, 1)->wait();
    EXPECT_EQ(b.to_vector<double>(), input_of(1, 5));

    std::vector<Tensor> outs;
    for (int r = 0; r < world; ++r) outs.push_back(zeros({4}));
    g.allgather(outs, tensor_of(input_of(g.rank(), 4), DType::f32))->wait();
    for (int r = 0; r < world; ++r) EXPECT_EQ(outs[r].to_vector<double>(), input_of(r, 4));

    // Rank r's input rows are [world, 2]; output row k is the sum of row k.
    Tensor in = prim::reshape(tensor_of(input_of(g.rank(), world * 2), DType::f64), {world, 2});
    Tensor out = zeros({1, 2}, DType::f64);
    g.reduce_scatter(out, in, dist::ReduceOp::sum)->wait();
    std::vector<double> expected(2, 0.0);
    for (int r = 0; r < world; ++r)
      for (int j = 0; j < 2; ++j) expected[j] += input_of(r, world * 2)[g.rank() * 2 + j];
    EXPECT_EQ(out.to_vector<double>(), expected);

    g.barrier()->wait();
  });
}

TEST(GlooProcessGroup, EveryCollectiveCountsAsAWriteOfWhatItWrites) {
  with_ranks(2, [&](ProcessGroup& g) {
    const Tensor a = zeros({4}), out = zeros({2}), in = zeros({4});
    const std::vector<Tensor> gathered = {zeros({4}), zeros({4})};
    const uint64_t a0 = a.version(), out0 = out.version(), in0 = in.version(), g0 = gathered[1].version();
    g.allreduce(a)->wait();
    g.broadcast(a, 1)->wait();
    EXPECT_EQ(a.version(), a0 + 2);
    g.allgather(gathered, a)->wait();
    EXPECT_EQ(gathered[1].version(), g0 + 1);
    EXPECT_EQ(a.version(), a0 + 2) << "an allgather's input is only read";
    g.reduce_scatter(out, in)->wait();
    EXPECT_EQ(out.version(), out0 + 1);
    EXPECT_EQ(in.version(), in0) << "a reduce-scatter's input is only read";

    // So a backward whose rule reads a tensor all-reduced since forward is
    // refused instead of using the sum of the ranks' values.
    const Tensor x = from_vector(std::vector<float>{1, 2, 3, 4}, {4}).set_requires_grad(true);
    const Tensor saved = from_vector(std::vector<float>{5, 6, 7, 8}, {4});
    const Tensor loss = sum(mul(x, saved));
    g.allreduce(saved)->wait();
    try {
      backward(loss);
      ADD_FAILURE() << "backward read a tensor that an allreduce wrote after forward";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("mul"), std::string::npos) << e.what();
    }
  });
}

TEST(GlooProcessGroup, ManyOutstandingWorksCompleteInOrder) {
  with_ranks(2, [&](ProcessGroup& g) {
    std::vector<Tensor> ts;
    std::vector<WorkPtr> works;
    for (int k = 0; k < 20; ++k) {
      ts.push_back(full({1000}, k + g.rank()));
      works.push_back(g.allreduce(ts.back()));
    }
    for (int k = 0; k < 20; ++k) {
      works[k]->wait();
      EXPECT_TRUE(works[k]->is_completed());
      EXPECT_EQ(ts[k].to_vector<double>()[999], 2.0 * k + 1);
    }
  });
}

// Reductions compute, which float8 does not: refused by name. Broadcast and
// allgather move its bytes as they are.
TEST(GlooProcessGroup, Float8MovesButDoesNotReduce) {
  with_ranks(2, [&](ProcessGroup& g) {
    for (DType t : {DType::e4m3, DType::e5m2}) {
      Tensor codes = Tensor::empty({256}, t);
      for (int c = 0; c < 256; ++c) static_cast<uint8_t*>(codes.data_ptr())[c] = static_cast<uint8_t>(c + g.rank());
      Tensor b = prim::clone(codes);
      g.broadcast(b, 1)->wait();
      for (int c = 0; c < 256; ++c) EXPECT_EQ(static_cast<uint8_t*>(b.data_ptr())[c], static_cast<uint8_t>(c + 1));
      std::vector<Tensor> outs = {zeros({256}, t), zeros({256}, t)};
      g.allgather(outs, codes)->wait();
      for (int r = 0; r < 2; ++r)
        for (int c = 0; c < 256; ++c)
          EXPECT_EQ(static_cast<uint8_t*>(outs[r].data_ptr())[c], static_cast<uint8_t>(c + r));
      mpt::testing::expect_contains(mpt::testing::error_of<DTypeError>([&] { g.allreduce(codes); }),
                                    {"allreduce", dtype_name(t)});
      mpt::testing::expect_contains(
          mpt::testing::error_of<DTypeError>([&] { g.reduce_scatter(zeros({128}, t), codes); }),
          {"reduce_scatter", dtype_name(t)});
    }
  });
}

TEST(GlooProcessGroup, BadArgumentsAreErrorsBeforeAnyCommunication) {
  with_ranks(1, [&](ProcessGroup& g) {
    EXPECT_THROW(g.allreduce(prim::transpose(zeros({2, 3}), 0, 1)), ValueError);
    EXPECT_THROW(g.allreduce(zeros({2}, DType::i32), dist::ReduceOp::avg), DTypeError);
    EXPECT_THROW(g.broadcast(zeros({2}), 1), ValueError);
  });
}

TEST(GlooProcessGroup, APeerThatNeverJoinsTimesOut) {
  using Clock = std::chrono::steady_clock;
  std::string message;
  double took = 0;
  std::atomic<bool> done{false};
  with_ranks(
      2,
      [&](ProcessGroup& g) {
        if (g.rank() == 1) {  // connected, alive, but never calls the collective
          while (!done) std::this_thread::sleep_for(milliseconds(5));
          return;
        }
        const auto start = Clock::now();
        try {
          g.allreduce(ones({8}))->wait();
        } catch (const TimeoutError& e) {
          message = e.what();
        }
        took = std::chrono::duration<double>(Clock::now() - start).count();
        done = true;
      },
      milliseconds(800));
  EXPECT_NE(message.find("allreduce(sum)"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 0 of 2"), std::string::npos) << message;
  EXPECT_NE(message.find("timeout 800 ms"), std::string::npos) << message;
  EXPECT_GE(took, 0.7);
  EXPECT_LT(took, 6.0);
}

TEST(GlooProcessGroup, APeerThatLeavesIsAnErrorNotAHang) {
  using Clock = std::chrono::steady_clock;
  std::string message;
  double took = 0;
  with_ranks(
      2,
      [&](ProcessGroup& g) {
        if (g.rank() == 1) return;  // its group closes its connections
        const auto start = Clock::now();
        try {
          g.allreduce(ones({8}))->wait();
        } catch (const Error& e) {
          message = e.what();
        }
        took = std::chrono::duration<double>(Clock::now() - start).count();
      },
      milliseconds(3000));
  EXPECT_NE(message.find("allreduce(sum)"), std::string::npos) << message;
  EXPECT_LT(took, 6.0);
}

// Collectives queued behind one that failed fail at once, naming it: a
// step's many bucket all-reduces end within one timeout, not one each.
TEST(GlooProcessGroup, CollectivesQueuedBehindAFailureFailAtOnce) {
  using Clock = std::chrono::steady_clock;
  std::vector<std::string> messages;
  double took = 0;
  with_ranks(
      2,
      [&](ProcessGroup& g) {
        if (g.rank() == 1) return;  // its group closes its connections
        const auto start = Clock::now();
        std::vector<WorkPtr> works;
        for (int i = 0; i < 8; ++i) works.push_back(g.allreduce(ones({8})));
        for (const WorkPtr& w : works) {
          try {
            w->wait();
          } catch (const Error& e) {  // the first a DistributedError or TimeoutError
            messages.push_back(e.what());
          }
        }
        took = std::chrono::duration<double>(Clock::now() - start).count();
      },
      milliseconds(3000));
  ASSERT_EQ(messages.size(), 8u);
  for (size_t i = 1; i < messages.size(); ++i)
    EXPECT_NE(messages[i].find("not run, since an earlier collective failed"), std::string::npos) << messages[i];
  EXPECT_LT(took, 6.0);
}

TEST(Buckets, FollowTheOrderAndCloseAtTheirCap) {
  // First cap 250, then 400: written out by hand from the rule "add the
  // parameter, close the bucket once it holds at least the cap".
  const std::vector<size_t> bytes = {100, 200, 300, 50, 390, 10};
  const std::vector<size_t> order = {5, 4, 3, 2, 1, 0};
  const std::vector<std::vector<size_t>> expected = {{5, 4}, {3, 2, 1}, {0}};
  EXPECT_EQ(assign_buckets(order, bytes, 250, 400), expected);
  // A gradient of at least the cap (parameter 4: 500 bytes) goes alone,
  // closing the bucket before it early.
  const std::vector<size_t> with_large = {100, 200, 300, 50, 500, 10};
  const std::vector<std::vector<size_t>> expected_large = {{5}, {4}, {3, 2, 1}, {0}};
  EXPECT_EQ(assign_buckets(order, with_large, 250, 400), expected_large);
  EXPECT_THROW(assign_buckets(order, bytes, 0, 1), ValueError);
}

TEST(DeviceRoutedGroup, CpuTensorsGoToGlooAndMissingBackendsSaySo) {
  const int port = mpt::testing::free_port();
  std::vector<std::thread> ranks;
  std::vector<std::exception_ptr> errors(2);
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      try {
        ProcessGroupOptions options;
        options.timeout = milliseconds(10000);
        auto d = init_process_group("env://", options, [&, r](const std::string& name) -> std::optional<std::string> {
          if (name == "RANK") return std::to_string(r);
          if (name == "WORLD_SIZE") return "2";
          if (name == "MASTER_ADDR") return "127.0.0.1";
          if (name == "MASTER_PORT") return std::to_string(port);
          return std::nullopt;
        });
        Tensor t = full({3}, r + 1.0);
        d.group->allreduce(t, dist::ReduceOp::sum)->wait();
        EXPECT_EQ(t.to_vector<double>(), (std::vector<double>{3, 3, 3}));
        d.group->barrier()->wait();
        if (!mpt::testing::has_cuda()) EXPECT_THROW(d.group->backend_for(Device("cuda:0")), Error);
        d.group->barrier()->wait();  // rank 0's store stays until both are done
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : ranks) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}
