// DistributedDataParallel with ranks as threads (Gloo over loopback): the
// construction-time checks, averaging against an explicit all-reduce of
// locally computed gradients, communication starting during backward, and
// the last bucket's all-reduce overlapped with the optimizer step.
#include <limits>

#include "amp/grad_scaler.h"
#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "models/adamw.h"
#include "models/batch_norm.h"
#include "models/mlp.h"
#include "parallel/counting_group.h"
#include "parallel/distributed_data_parallel.h"
#include "parallel/thread_ranks.h"
#include "parallel/tiny_models.h"
#include "test_util.h"
#include "train/trainer.h"

using namespace mpt;
using namespace mpt::dist;
using mpt::testing::host_f64;
using mpt::testing::with_ranks;

namespace {

std::shared_ptr<ProcessGroup> borrowed(ProcessGroup& g) {
  return std::shared_ptr<ProcessGroup>(&g, [](ProcessGroup*) {});
}

}  // namespace

TEST(Ddp, DifferentModelsAreAnErrorNamingTheFirstDifference) {
  std::vector<std::string> messages(2);
  with_ranks(2, [&](ProcessGroup& g) {
    std::shared_ptr<nn::Module> model;
    if (g.rank() == 0) model = mpt::testing::make_mlp(1);
    else model = std::make_shared<mpt::testing::WithSpareHead>(1);
    try {
      DistributedDataParallel ddp(model, borrowed(g));
    } catch (const ValueError& e) {
      messages[g.rank()] = e.what();
    }
  });
  EXPECT_NE(messages[1].find("parameter 0 differs: rank 0 has '0.weight [24, 6] f32', rank 1 has 'used.weight [3, 6] "
                             "f32'"),
            std::string::npos)
      << messages[1];
  EXPECT_NE(messages[0].find("differ from rank 0's"), std::string::npos) << messages[0];
}

TEST(Ddp, ConstructionCopiesRankZerosParameters) {
  with_ranks(2, [&](ProcessGroup& g) {
    auto model = mpt::testing::make_mlp(5);
    if (g.rank() == 1) {
      NoGradGuard no_grad;
      for (auto& p : model->parameters()) prim::fill_(p, -3.0);
    }
    DistributedDataParallel ddp(model, borrowed(g));
    auto fresh = mpt::testing::make_mlp(5);  // what rank 0 holds
    auto got = model->parameters(), want = fresh->parameters();
    for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i].to_vector<float>(), want[i].to_vector<float>());
  });
}

// PyTorch's broadcast_buffers: each forward whose backward synchronises
// starts from rank 0's buffers; one inside no_sync() or without grad keeps
// the rank's own. Rank r's inputs have mean r + 1, and each forward moves
// the running mean halfway to it.
TEST(Ddp, BuffersFollowRankZeroBeforeEachSynchronisedForward) {
  with_ranks(2, [&](ProcessGroup& g) {
    auto model = std::make_shared<mpt::testing::WithRunningMean>(1);
    if (g.rank() == 1) prim::fill_(model->running_mean, -3.0);
    DistributedDataParallel ddp(model, borrowed(g));
    EXPECT_EQ(model->running_mean.item(), 0.0) << "construction copies rank 0's buffers";

    const double own = g.rank() + 1;
    const Tensor x = prim::mul_scalar(ones({4, 6}), own);
    auto step = [&] { backward(sum(ddp(x))); };
    auto seen = [&] { return model->seen.item(); };
    auto next = [&](double running) { return 0.5 * running + 0.5 * own; };

    step();
    EXPECT_EQ(seen(), 0.0);
    step();
    EXPECT_EQ(seen(), 0.5) << "rank 0's running mean after the first forward";
    double running = next(0.5);
    {
      auto guard = ddp.no_sync();
      step();
      EXPECT_EQ(seen(), running) << "no_sync keeps the rank's own buffers";
      running = next(running);
    }
    {
      NoGradGuard no_grad;
      ddp(x);
      EXPECT_EQ(seen(), running) << "a forward without grad keeps the rank's own buffers";
      running = next(running);
    }
    step();
    // Rank 0's running mean went 0.5 -> 0.75 -> 0.875 -> 0.9375 over the
    // second, the no_sync and the no-grad forward.
    EXPECT_EQ(seen(), 0.9375) << "rank 0's after its unsynchronised forwards";
  });
}

// A batch norm's running statistics and its i64 batch count follow rank 0
// at each synchronised forward, then take the rank's own batch, as in
// PyTorch: rank 1 ends with rank 0's statistics moved once towards its own.
TEST(Ddp, BatchNormStatisticsStartEachSynchronisedForwardFromRankZeros) {
  const uint64_t seed = mpt::testing::fresh_seed();
  SCOPED_TRACE(seed);
  with_ranks(2, [&](ProcessGroup& g) {
    auto bn = std::make_shared<nn::BatchNorm1d>(3);
    DistributedDataParallel ddp(bn, borrowed(g));
    // Each rank's batches; both ranks draw both, so each knows the other's.
    Generator gen(seed);
    std::vector<std::vector<Tensor>> batches(2);
    for (auto& rank_batches : batches)
      for (int i = 0; i < 3; ++i) rank_batches.push_back(randn({8, 3}, DType::f32, kCPU, &gen));
    const auto& own = batches[g.rank()];
    auto batch_mean = [](const Tensor& x) { return host_f64(prim::mean(x, {0})); };

    {
      auto guard = ddp.no_sync();  // each rank on its own: rank 1 counts one more batch
      for (int i = 0; i < 1 + g.rank(); ++i) backward(sum(ddp(own[i])));
    }
    EXPECT_EQ(bn->num_batches_tracked.item(), 1 + g.rank());
    backward(sum(ddp(own[2])));
    // Rank 0's state after its one batch, moved by this rank's third.
    const std::vector<double> zero_after_one = batch_mean(batches[0][0]), third = batch_mean(own[2]);
    const std::vector<double> running = host_f64(bn->running_mean);
    for (int c = 0; c < 3; ++c)
      EXPECT_NEAR(running[c], 0.9 * (0.1 * zero_after_one[c]) + 0.1 * third[c], 1e-6) << "channel " << c;
    EXPECT_EQ(bn->num_batches_tracked.item(), 2) << "rank 0's count, plus one";
  });
}

TEST(Ddp, GradientsAreTheAverageOfTheRanksGradients) {
  const uint64_t seed = mpt::testing::fresh_seed();
  SCOPED_TRACE(seed);
  with_ranks(2, [&](ProcessGroup& g) {
    Generator gen(seed + g.rank());  // each rank its own data
    const Tensor x = randn({5, 6}, DType::f32, kCPU, &gen), y = randn({5, 3}, DType::f32, kCPU, &gen);

    // The rule, stated directly: each rank's local gradient, averaged by an
    // explicit all-reduce.
    auto alone = mpt::testing::make_mlp(seed);
    backward(mse_loss(alone->forward(x), y));
    std::vector<Tensor> expected;
    for (auto& p : alone->parameters()) {
      expected.push_back(p.grad());
      g.allreduce(expected.back(), dist::ReduceOp::avg)->wait();
    }

    auto model = mpt::testing::make_mlp(seed);
    DistributedDataParallel ddp(model, borrowed(g), {.first_bucket_bytes = 200, .bucket_bytes = 600});
    for (int step = 0; step < 2; ++step) {  // the second runs on rebuilt buckets
      model->zero_grad();
      backward(mse_loss(ddp(x), y));
      auto params = model->parameters();
      for (size_t i = 0; i < params.size(); ++i)
        EXPECT_LE(mpt::testing::rel_error(params[i].grad().to_vector<double>(), expected[i].to_vector<double>()), 1e-6)
            << "parameter " << i << " step " << step;
    }
    EXPECT_TRUE(ddp.buckets_rebuilt());
  });
}

// Without a first-bucket cap the first bucket fills to the common cap.
TEST(Ddp, AFirstBucketCapOfZeroMeansTheCommonCap) {
  with_ranks(2, [&](ProcessGroup& g) {
    auto buckets = [&](DdpOptions options) {
      return DistributedDataParallel(mpt::testing::make_mlp(7), borrowed(g), options).bucket_assignment();
    };
    // Gradient bytes in reverse order: 12, 192, 64, 1536, 96, 576.
    const auto common = buckets({.bucket_bytes = 600});
    EXPECT_EQ(common, (std::vector<std::vector<size_t>>{{5, 4, 3}, {2}, {1, 0}}));
    EXPECT_EQ(common, buckets({.first_bucket_bytes = 600, .bucket_bytes = 600}));
    EXPECT_EQ(buckets({.first_bucket_bytes = 200, .bucket_bytes = 600}),
              (std::vector<std::vector<size_t>>{{5, 4}, {3}, {2}, {1, 0}}));
  });
}

// The averaged gradients stay in the buckets as the parameters' gradients
// (no copy back), each starting on a 64-byte boundary so that the fused
// optimizers read them with wide loads; the next synchronised backward
// writes the new averages into the same memory.
TEST(Ddp, GradientsAreAlignedViewsIntoTheBuckets) {
  with_ranks(2, [&](ProcessGroup& g) {
    auto model = mpt::testing::make_mlp(7);  // sizes 144, 24, 384, 16, 48, 3: some not multiples of 16
    DistributedDataParallel ddp(model, borrowed(g), {.first_bucket_bytes = 200, .bucket_bytes = 600});
    Generator gen(11 + g.rank());
    const auto params = model->parameters();
    for (int step = 0; step < 3; ++step) {
      const Tensor x = randn({5, 6}, DType::f32, kCPU, &gen), y = randn({5, 3}, DType::f32, kCPU, &gen);
      model->zero_grad();
      backward(mse_loss(ddp(x), y));
      // A bucket's gradients lie one after the other in one buffer, each
      // starting on a 64-byte boundary (16 floats).
      for (const auto& bucket : ddp.bucket_assignment()) {
        const auto* base = static_cast<const char*>(params[bucket[0]].grad().data_ptr());
        int64_t offset = 0;
        for (size_t index : bucket) {
          const auto* at = static_cast<const char*>(params[index].grad().data_ptr());
          EXPECT_EQ(reinterpret_cast<uintptr_t>(at) % 64, 0u) << "step " << step << ", parameter " << index;
          EXPECT_EQ(at - base, offset * 4) << "step " << step << ", parameter " << index;
          offset += (params[index].numel() + 15) / 16 * 16;
        }
      }
    }
  });
}

// A gradient of at least the bucket cap has a bucket of its own and is
// averaged where backward left it: the parameter's gradient after backward
// is the tensor backward accumulated, holding the average.
TEST(Ddp, AGradientAloneInItsBucketIsAveragedInPlace) {
  with_ranks(2, [&](ProcessGroup& g) {
    auto model = mpt::testing::make_mlp(5);  // parameter 2: 16 x 24 floats = 1536 bytes, above the cap
    auto param = model->parameters()[2];
    // A hook placed before DDP's sees the gradient as backward left it.
    const void* accumulated = nullptr;
    param.autograd_meta().post_accumulate_hooks.push_back(
        [&](const Tensor& p) { accumulated = p.grad().data_ptr(); });
    DistributedDataParallel ddp(model, borrowed(g), {.first_bucket_bytes = 200, .bucket_bytes = 600});
    bool alone = false;
    for (const auto& bucket : ddp.bucket_assignment()) alone |= bucket == std::vector<size_t>{2};
    ASSERT_TRUE(alone);

    Generator gen(21 + g.rank());
    const Tensor x = randn({5, 6}, DType::f32, kCPU, &gen), y = randn({5, 3}, DType::f32, kCPU, &gen);
    auto local = mpt::testing::make_mlp(5);
    backward(mse_loss(local->forward(x), y));
    Tensor expected = local->parameters()[2].grad();
    g.allreduce(expected, dist::ReduceOp::avg)->wait();

    backward(mse_loss(ddp(x), y));
    EXPECT_EQ(param.grad().data_ptr(), accumulated);
    EXPECT_LE(mpt::testing::rel_error(param.grad().to_vector<double>(), expected.to_vector<double>()), 1e-6);
  });
}

// Two heads; rank 1 leaves the first out of its loss.
class HeadUsedOnRankZero : public nn::Module {
 public:
  explicit HeadUsedOnRankZero(int rank) : Module("HeadUsedOnRankZero"), rank_(rank) {
    Generator gen(3);
    first = register_module("first", std::make_shared<nn::Linear>(6, 7, false, &gen));  // 42 floats: padding would add 6
    second = register_module("second", std::make_shared<nn::Linear>(6, 3, true, &gen));
  }
  Tensor forward(const Tensor& x) override {
    const Tensor out = second->forward(x);
    return rank_ == 0 ? out + sum(first->forward(x)) : out;
  }
  std::shared_ptr<nn::Linear> first, second;

 private:
  int rank_;
};

// A gradient alone in its bucket, produced on one rank only: both ranks
// must make the same all-reduce (same count, same op), and both end with
// the average of rank 0's gradient and nothing.
TEST(Ddp, AGradientAloneInItsBucketAndUsedOnOneRankIsAveragedOnBoth) {
  const uint64_t seed = mpt::testing::fresh_seed();
  SCOPED_TRACE(seed);
  std::vector<std::vector<double>> got(2);
  std::vector<double> rank0_local;
  with_ranks(2, [&](ProcessGroup& g) {
    auto model = std::make_shared<HeadUsedOnRankZero>(g.rank());
    DistributedDataParallel ddp(model, borrowed(g), {.bucket_bytes = 100, .find_unused_parameters = true});
    bool alone = false;
    for (const auto& bucket : ddp.bucket_assignment()) alone |= bucket == std::vector<size_t>{0};
    ASSERT_TRUE(alone);
    Generator gen(seed + g.rank());
    const Tensor x = randn({5, 6}, DType::f32, kCPU, &gen), y = randn({5, 3}, DType::f32, kCPU, &gen);
    if (g.rank() == 0) {
      auto local = std::make_shared<HeadUsedOnRankZero>(0);
      backward(mse_loss(local->forward(x), y));
      rank0_local = local->first->weight.grad().to_vector<double>();
    }
    backward(mse_loss(ddp(x), y));
    ASSERT_TRUE(model->first->weight.grad().defined()) << "rank " << g.rank();
    got[g.rank()] = model->first->weight.grad().to_vector<double>();
  });
  std::vector<double> want(rank0_local.size());
  for (size_t i = 0; i < want.size(); ++i) want[i] = rank0_local[i] / 2;
  EXPECT_LE(mpt::testing::rel_error(got[0], want), 1e-6);
  EXPECT_LE(mpt::testing::rel_error(got[1], want), 1e-6);
}

// With f16 or bf16 compression each rank's gradient travels as
// t(g / world) in the transit type t, the ranks' halves are summed and
// rounded to t, and the result comes back to f32: exactly that, element for
// element. A loss scale of 1e6 puts the f16 sums beyond f16's range: they
// arrive as inf (NaN where the ranks' infs differ in sign), for the loss
// scaler to find, where f32 transit stays finite. bf16 has f32's exponent
// range (its largest value is within 0.4% of f32's), so a sum that is finite
// in f32 transit cannot overflow it by more than that sliver: there the same
// scale must stay finite, and overflow is f16's case only.
TEST(Ddp, CompressedGradientsAreTheRoundedAverageAndOverflowToInf) {
  const uint64_t seed = mpt::testing::fresh_seed();
  SCOPED_TRACE(seed);
  for (const DType transit : {DType::f16, DType::bf16})
    for (const double loss_scale : {1.0, 1e6}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(transit) << ", loss scale " << loss_scale);
      with_ranks(2, [&](ProcessGroup& g) {
        Generator gen(seed + g.rank());
        const Tensor x = randn({5, 6}, DType::f32, kCPU, &gen), y = randn({5, 3}, DType::f32, kCPU, &gen);
        auto local = mpt::testing::make_mlp(seed);
        backward(mul(mse_loss(local->forward(x), y), loss_scale));
        std::vector<Tensor> expected;
        bool f32_finite = true;
        for (auto& p : local->parameters()) {
          for (double v : p.grad().to_vector<double>()) f32_finite &= std::isfinite(v);
          Tensor half = prim::to(prim::mul_scalar(p.grad(), 0.5), transit);
          g.allreduce(half, dist::ReduceOp::sum)->wait();
          expected.push_back(prim::to(half, DType::f32));
        }
        EXPECT_TRUE(f32_finite);

        auto model = mpt::testing::make_mlp(seed);
        DistributedDataParallel ddp(model, borrowed(g),
                                    {.first_bucket_bytes = 200, .bucket_bytes = 600, .compression = transit});
        backward(mul(mse_loss(ddp(x), y), loss_scale));
        bool any_nonfinite = false;
        auto params = model->parameters();
        for (size_t i = 0; i < params.size(); ++i) {
          ASSERT_EQ(params[i].grad().dtype(), DType::f32);
          const auto got = params[i].grad().to_vector<float>(), want = expected[i].to_vector<float>();
          ASSERT_EQ(got.size(), want.size());
          for (size_t j = 0; j < got.size(); ++j) {
            any_nonfinite |= !std::isfinite(got[j]);
            // inf + -inf from two ranks is NaN on both sides.
            if (!(std::isnan(got[j]) && std::isnan(want[j])))
              ASSERT_EQ(got[j], want[j]) << dtype_name(transit) << ", loss scale " << loss_scale << ", parameter "
                                         << i << " element " << j;
          }
        }
        // (The trace above is the main thread's; ranks run on their own.)
        EXPECT_EQ(any_nonfinite, transit == DType::f16 && loss_scale > 1)
            << dtype_name(transit) << ", loss scale " << loss_scale;
      });
    }
}

TEST(Ddp, AllReducesStartWhileBackwardIsStillRunning) {
  with_ranks(2, [&](ProcessGroup& g) {
    auto counting = std::make_shared<mpt::testing::CountingGroup>(g);
    auto model = mpt::testing::make_mlp(3);
    // The first registered parameter gets its gradient last: a hook placed
    // before DDP's sees how many buckets were already on their way.
    int launched_before_last_gradient = -1;
    model->parameters()[0].autograd_meta().post_accumulate_hooks.push_back(
        [&](const Tensor&) { launched_before_last_gradient = counting->allreduces; });
    DistributedDataParallel ddp(model, counting, {.first_bucket_bytes = 200, .bucket_bytes = 600});
    const int buckets = static_cast<int>(ddp.bucket_assignment().size());
    ASSERT_GE(buckets, 3);
    const int before = counting->allreduces;
    backward(mse_loss(ddp(randn({4, 6})), randn({4, 3})));
    EXPECT_EQ(counting->allreduces - before, buckets);
    EXPECT_GE(launched_before_last_gradient - before, buckets - 1);
  });
}

TEST(Ddp, FoundInfIsTheMaximumOverRanks) {
  with_ranks(3, [&](ProcessGroup& g) {
    Tensor found_inf = full({1}, g.rank() == 2 ? 1.0 : 0.0);
    allreduce_found_inf(g, found_inf);
    EXPECT_EQ(found_inf.item(), 1.0);
    EXPECT_THROW(allreduce_found_inf(g, zeros({2})), ShapeError);
  });
}

namespace {

// An AdamW that counts the parts the scaler stepped it in.
struct PartCountingAdamW : optim::AdamW {
  using optim::AdamW::AdamW;
  int parts = 0;
  void step_part(const std::vector<Tensor>& only, const Tensor& found_inf) override {
    ++parts;
    optim::AdamW::step_part(only, found_inf);
  }
};

// Six steps of mixed-precision style training through DDP and a scaler;
// what they leave behind.
struct ScaledRun {
  std::vector<double> params;
  std::vector<double> scales;  // after each update
  std::vector<int64_t> step_counts;
  int parts = 0;
};

// `late_inf_at`: on rank 1, the step whose last-bucket gradient (and only
// that) turns inf before DDP sees it. `unscale_at`: the step that unscales
// explicitly before stepping (as for clipping).
ScaledRun scaled_run(ProcessGroup& g, const std::function<std::shared_ptr<nn::Module>()>& make_model,
                     DdpOptions options, bool overlap, bool scaler_on, int late_inf_at, int unscale_at) {
  auto model = make_model();
  DistributedDataParallel ddp(model, borrowed(g), options);
  PartCountingAdamW opt(model->parameters(), optim::AdamWOptions{.lr = 1e-2});
  amp::GradScaler scaler({.init_scale = 1024.0, .growth_interval = 2, .enabled = scaler_on});
  if (overlap) ddp.overlap_step_with(scaler);
  const mpt::testing::MlpBatches data(6, 5, 77 + g.rank());
  ScaledRun run;
  for (int step = 0; step < 6; ++step) {
    opt.zero_grad();
    if (g.rank() == 1 && step == late_inf_at) {
      // Placed before DDP's hooks: the gradient DDP checks and averages.
      Tensor p = model->parameters()[ddp.bucket_assignment().back().front()];
      auto& hooks = p.autograd_meta().post_accumulate_hooks;
      hooks.push_back([](const Tensor& leaf) { prim::fill_(leaf.grad(), std::numeric_limits<double>::infinity()); });
      backward(scaler.scale(mse_loss(ddp(data.x(step)), data.y(step))));
      hooks.clear();
    } else {
      backward(scaler.scale(mse_loss(ddp(data.x(step)), data.y(step))));
    }
    if (step == unscale_at) scaler.unscale_(opt);
    scaler.step(opt);
    scaler.update();
    run.scales.push_back(scaler_on ? scaler.get_scale() : 0.0);
  }
  run.params = mpt::testing::flat_parameters(*model);
  for (size_t i = 0; i < opt.num_params(); ++i) run.step_counts.push_back(opt.step_count(i));
  run.parts = opt.parts;
  return run;
}

std::shared_ptr<nn::Module> first_layer_without_bias() {
  Generator gen(8);
  auto m = std::make_shared<nn::Sequential>();
  m->push_back(std::make_shared<nn::Linear>(6, 24, false, &gen));  // 576 bytes, produced last
  m->push_back(std::make_shared<nn::ReLU>());
  m->push_back(std::make_shared<nn::Linear>(24, 3, true, &gen));
  return m;
}

}  // namespace

// overlap_step_with: backward leaves the last bucket travelling and the
// scaler steps the other parameters meanwhile, then the late ones. The
// training is the same, bit for bit, as with the whole backward waited for:
// parameters, scales and step counts, through a step skipped on both ranks
// for an inf that only rank 1's last bucket held (found by the check before
// the average), a step unscaled explicitly first (which waits for every
// gradient), and with the scaler off. Both the bucket filled by copies and
// the large gradient averaged in place take part.
TEST(Ddp, AnOverlappedStepTrainsAsTheStepAfterTheWholeBackward) {
  struct Case {
    const char* what;
    std::function<std::shared_ptr<nn::Module>()> model;
    DdpOptions options;
  };
  const std::vector<Case> cases = {
      {"last bucket filled", [] { return mpt::testing::make_mlp(5); }, {.first_bucket_bytes = 200, .bucket_bytes = 600}},
      {"last gradient averaged in place", first_layer_without_bias, {.bucket_bytes = 500}},
  };
  for (const Case& c : cases)
    for (const bool scaler_on : {true, false}) {
      SCOPED_TRACE(::testing::Message() << c.what << ", scaler " << (scaler_on ? "on" : "off"));
      with_ranks(2, [&](ProcessGroup& g) {
        // Without a scaler nothing skips the inf's step: none is injected.
        const int late_inf_at = scaler_on ? 3 : -1;
        const ScaledRun plain = scaled_run(g, c.model, c.options, false, scaler_on, late_inf_at, 4);
        const ScaledRun overlapped = scaled_run(g, c.model, c.options, true, scaler_on, late_inf_at, 4);
        EXPECT_EQ(overlapped.params, plain.params);
        EXPECT_EQ(overlapped.scales, plain.scales);
        EXPECT_EQ(overlapped.step_counts, plain.step_counts);
        EXPECT_EQ(plain.parts, 0);
        // Two parts a step, except the step unscaled first and (decided on
        // the host before either part) the skipped one.
        EXPECT_EQ(overlapped.parts, 2 * (scaler_on ? 4 : 5));
        if (scaler_on) {
          // The late inf skipped step 3 on both ranks: the scale backed off
          // there, and no parameter counts six updates.
          EXPECT_EQ(plain.scales[3], plain.scales[2] / 2);
          for (int64_t n : plain.step_counts) EXPECT_EQ(n, 5);
        }
      });
    }
}

// Without a scaler to take them, the late gradients become final with
// wait_for_gradients() (or at the next forward).
TEST(Ddp, WaitForGradientsMakesTheLateBucketFinal) {
  with_ranks(2, [&](ProcessGroup& g) {
    Generator gen(31 + g.rank());
    const Tensor x = randn({5, 6}, DType::f32, kCPU, &gen), y = randn({5, 3}, DType::f32, kCPU, &gen);
    auto plain_model = mpt::testing::make_mlp(5), model = mpt::testing::make_mlp(5);
    const DdpOptions small_buckets{.first_bucket_bytes = 200, .bucket_bytes = 600};
    DistributedDataParallel plain(plain_model, borrowed(g), small_buckets);
    DistributedDataParallel ddp(model, borrowed(g), small_buckets);
    amp::GradScaler scaler;
    ddp.overlap_step_with(scaler);
    for (int step = 0; step < 2; ++step) {
      backward(mse_loss(plain(x), y));
      backward(mse_loss(ddp(x), y));
      ddp.wait_for_gradients();
      const auto want = plain_model->parameters(), got = model->parameters();
      for (size_t i = 0; i < got.size(); ++i)
        EXPECT_EQ(got[i].grad().to_vector<float>(), want[i].grad().to_vector<float>()) << "parameter " << i;
      plain_model->zero_grad();
      model->zero_grad();
    }
  });
}

// With one bucket there is nothing to step beside it: the step is whole.
TEST(Ddp, AnOverlappedStepWithOneBucketIsAWholeStep) {
  with_ranks(2, [&](ProcessGroup& g) {
    const auto model = [] { return mpt::testing::make_mlp(5); };
    const ScaledRun plain = scaled_run(g, model, {}, false, true, 3, 4);
    const ScaledRun overlapped = scaled_run(g, model, {}, true, true, 3, 4);
    EXPECT_EQ(overlapped.params, plain.params);
    EXPECT_EQ(overlapped.scales, plain.scales);
    EXPECT_EQ(overlapped.parts, 0);
  });
}

TEST(Ddp, OverlapStepWithRefusesWhatItCannotOverlap) {
  with_ranks(2, [&](ProcessGroup& g) {
    amp::GradScaler scaler;
    DistributedDataParallel compressed(mpt::testing::make_mlp(5), borrowed(g), {.compression = DType::f16});
    mpt::testing::expect_contains(
        mpt::testing::error_of<ValueError>([&] { compressed.overlap_step_with(scaler); }), {"compression"});
    DistributedDataParallel unused(mpt::testing::make_mlp(5), borrowed(g), {.find_unused_parameters = true});
    mpt::testing::expect_contains(mpt::testing::error_of<ValueError>([&] { unused.overlap_step_with(scaler); }),
                                  {"find_unused_parameters"});
    DistributedDataParallel ddp(mpt::testing::make_mlp(5), borrowed(g));
    ddp.overlap_step_with(scaler);
    mpt::testing::expect_contains(mpt::testing::error_of<ValueError>([&] { ddp.overlap_step_with(scaler); }),
                                  {"already"});
  });
}

// fp8 under DDP: each rank quantizes its own batch, the step's amaxes are
// all-reduced (max) before the scales are updated, so both ranks keep the
// same scales and histories (and so the same weights): here rank 1's
// inputs are 8 times rank 0's, and its amax is the one recorded on both.
TEST(Ddp, Fp8ScalesAndHistoriesAgreeAcrossRanks) {
  std::vector<std::vector<std::vector<double>>> states(2);
  std::vector<std::vector<double>> weights(2);
  std::vector<float> input_amax(2);
  with_ranks(2, [&](ProcessGroup& g) {
    Generator gen(5);
    auto model = nn::make_mlp({.in_features = 16, .hidden = {32}, .num_classes = 3}, &gen);
    train::TrainerOptions o;
    o.step.precision = train::Precision::fp8;
    o.step.fp8.history_length = 4;
    o.parallel = train::Parallel::ddp;
    o.group = borrowed(g);
    train::Trainer trainer(model, std::make_unique<optim::AdamW>(model->parameters(), optim::AdamWOptions{.lr = 1e-2}),
                           train::classification(), o);
    Generator data(100 + g.rank());
    const Tensor x = randn({16, 16}, DType::f32, kCPU, &data) * (g.rank() == 1 ? 8.0 : 1.0);
    const Tensor y = from_vector(std::vector<int64_t>(16, g.rank()), {16}, DType::i64);
    input_amax[g.rank()] = static_cast<float>(prim::amax(prim::unary(UnaryOp::abs, x, 0.0, 0.0)).item());
    for (int step = 0; step < 3; ++step) trainer.step({data::Batch{x, y}});
    for (const auto& [name, t] : trainer.precision().fp8_scaling()->state()) states[g.rank()].push_back(t.to_vector<double>());
    weights[g.rank()] = mpt::testing::flat_parameters(*model);
  });
  ASSERT_FALSE(states[0].empty());
  EXPECT_EQ(states[0], states[1]);
  EXPECT_EQ(weights[0], weights[1]);
  // forward.history ([2 slots, 4]): the input's slot holds rank 1's amax.
  const std::vector<double>& history = states[0][2];
  ASSERT_EQ(history.size(), 8u);
  for (int s = 0; s < 3; ++s) EXPECT_EQ(history[s], input_amax[1]) << "step " << s;
}
