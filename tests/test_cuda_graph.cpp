// CapturedStep on the GPU: a mixed-precision training step (autocast f16,
// GradScaler, capturable AdamW) recorded as a CUDA graph and replayed gives
// the same parameters, scale and step counts as the same steps run eagerly,
// including steps the scaler skips on the device; new batch shapes capture
// again; a step that synchronizes falls back to eager; replays allocate
// nothing; batches copied in ahead of their steps train as batches copied
// at the step; a learning rate set between replays takes effect, for
// capturable AdamW and SGD (momentum started at its first real update). A
// graph's memory: shapes that come back capture into the memory of the
// graphs they dropped, and a dropped graph's memory serves eager work on
// the stream of its replays, a replay on another stream waiting for the
// work queued before the capture ended; a replay inside another capture is
// refused.
// Index checks on the GPU report at the next synchronization.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <random>

#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "autograd/beside.h"
#include "autograd/engine.h"
#include "autograd/ops.h"
#include "models/adamw.h"
#include "models/layers.h"
#include "models/sequential.h"
#include "models/sgd.h"
#include "tensor/cuda/conv_cudnn.h"
#include "tensor/cuda/graph.h"
#include "tensor/device_guard.h"
#include "tensor/gpu_timeline.h"
#include "tensor/graph.h"
#include "tensor/memory.h"
#include "tensor/pinned.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

using testing::busy_gpu;
using testing::host_f64;
using testing::rel_error;

const Device kGPU("cuda:0");

// One training setup: model (inputs of `width`, one hidden layer of
// `hidden`), capturable AdamW (or SGD: use_sgd()), a scaler whose scale
// moves (2^24 overflows f16 gradients at first, so early steps are skipped
// and the scale backs off; afterwards it grows every 3 clean steps).
struct TrainingRun {
  std::shared_ptr<nn::Sequential> model;
  std::unique_ptr<optim::Optimizer> opt;
  amp::GradScaler scaler;
  bool read_loss_inside = false;  // makes the step synchronize
  bool busy_before_reading = false;  // GPU work ahead of the first read of the inputs
  bool mark_consumed = false;        // CapturedStep::inputs_consumed() after backward

  explicit TrainingRun(uint64_t seed, int64_t width = 32, int64_t hidden = 64, Device device = kGPU)
      : scaler([] {
          amp::GradScalerOptions o;
          o.init_scale = 16777216.0;
          o.growth_interval = 3;
          return o;
        }()) {
    Generator gen(seed);
    model = std::make_shared<nn::Sequential>();
    model->push_back(std::make_shared<nn::Linear>(width, hidden, true, &gen));
    model->push_back(std::make_shared<nn::ReLU>());
    model->push_back(std::make_shared<nn::Linear>(hidden, 10, true, &gen));
    model->to(device);
    opt = std::make_unique<optim::AdamW>(model->parameters(), optim::AdamWOptions{1e-2, 0.9, 0.999, 1e-8, 1e-2});
    opt->set_capturable(true);
  }

  // Capturable SGD in place of AdamW (before the first step).
  void use_sgd(const optim::SGDOptions& options) {
    opt = std::make_unique<optim::SGD>(model->parameters(), options);
    opt->set_capturable(true);
  }

  void step(const std::vector<Tensor>& in) {
    opt->zero_grad();
    if (busy_before_reading) busy_gpu(in[0].device());
    Tensor loss;
    {
      amp::AutocastGuard autocast(DeviceType::cuda, DType::f16);
      loss = cross_entropy(model->forward(in[0]), in[1]);
    }
    if (read_loss_inside) (void)loss.item();
    backward(scaler.scale(loss));
    if (mark_consumed) CapturedStep::inputs_consumed();
    scaler.step(*opt);
    scaler.update();
  }
};

// x [rows, width] and labels in [0, 10), on the host (run() copies them in).
std::vector<Tensor> batch(std::mt19937_64& rng, int64_t rows, int64_t width = 32) {
  Generator gen(rng());
  std::vector<int64_t> labels(static_cast<size_t>(rows));
  for (int64_t& l : labels) l = static_cast<int64_t>(rng() % 10);
  return {randn({rows, width}, DType::f32, kCPU, &gen), from_vector(labels, {rows}, DType::i64)};
}

void expect_same_training(TrainingRun& a, TrainingRun& b) {
  const auto pa = a.model->parameters(), pb = b.model->parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_LE(rel_error(host_f64(pa[i]), host_f64(pb[i])), 1e-6) << "parameter " << i;
  EXPECT_EQ(a.scaler.get_scale(), b.scaler.get_scale());
  EXPECT_EQ(a.scaler.growth_tracker(), b.scaler.growth_tracker());
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_EQ(a.opt->step_count(i), b.opt->step_count(i)) << "parameter " << i;
}

TEST(CudaGraph, ReplayedStepsTrainLikeEagerOnes) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  TrainingRun graphed(seed), eager(seed);
  CapturedStep captured(kGPU, [&](const std::vector<Tensor>& in) { graphed.step(in); });
  std::mt19937_64 rng(seed + 1);
  uint64_t reserved_after_capture = 0;
  for (int i = 0; i < 30; ++i) {
    const std::vector<Tensor> in = batch(rng, 48);
    captured.run(in);
    eager.step({prim::to(in[0], kGPU), prim::to(in[1], kGPU)});
    if (i == 4) reserved_after_capture = memory_stats(kGPU).reserved_bytes;
  }
  EXPECT_EQ(captured.captures(), 1);
  EXPECT_EQ(captured.replays(), 27);  // 3 eager steps first
  EXPECT_EQ(captured.fallback_reason(), "");
  expect_same_training(graphed, eager);
  // Some steps overflowed and were skipped inside the graph; the scale moved.
  EXPECT_LT(graphed.opt->step_count(0), 30);
  EXPECT_LT(graphed.scaler.get_scale(), 16777216.0);
  // Replays take no new memory.
  EXPECT_EQ(memory_stats(kGPU).reserved_bytes, reserved_after_capture);
}

// Layers large enough that their weight gradients run beside the chain of
// input gradients on a second stream (autograd/beside.h), forked from and
// joined into the captured stream, their memory from the graph's pool; the
// eager run computes them in order on one stream.
TEST(CudaGraph, ReplayedStepsWithWeightGradientsBesideTrainLikeOrderedEagerOnes) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  constexpr int64_t kWidth = 1024, kRows = 1024;  // a first-layer weight gradient of 2^30 multiply-adds
  TrainingRun graphed(seed, kWidth, kWidth), eager(seed, kWidth, kWidth);
  CapturedStep captured(kGPU, [&](const std::vector<Tensor>& in) { graphed.step(in); });
  std::mt19937_64 rng(seed + 1);
  uint64_t reserved_after_capture = 0;
  for (int i = 0; i < 12; ++i) {
    const std::vector<Tensor> in = batch(rng, kRows, kWidth);
    captured.run(in);
    beside::set_enabled(false);
    eager.step({prim::to(in[0], kGPU), prim::to(in[1], kGPU)});
    beside::set_enabled(true);
    if (i == 4) reserved_after_capture = memory_stats(kGPU).reserved_bytes;
  }
  EXPECT_EQ(captured.captures(), 1);
  EXPECT_EQ(captured.fallback_reason(), "");
  expect_same_training(graphed, eager);
  EXPECT_EQ(memory_stats(kGPU).reserved_bytes, reserved_after_capture);
}

TEST(CudaGraph, NewShapesCaptureAgain) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  TrainingRun graphed(seed), eager(seed);
  CapturedStep captured(kGPU, [&](const std::vector<Tensor>& in) { graphed.step(in); }, 2);
  std::mt19937_64 rng(seed + 1);
  for (int i = 0; i < 16; ++i) {
    const std::vector<Tensor> in = batch(rng, i < 8 ? 16 : 24);
    captured.run(in);
    eager.step({prim::to(in[0], kGPU), prim::to(in[1], kGPU)});
  }
  EXPECT_EQ(captured.captures(), 2);
  EXPECT_EQ(captured.replays(), 12);
  expect_same_training(graphed, eager);
}

// Twelve steps of `graphed` on `device` through run(batch, next), each
// batch from make_batch() copied in during the step before, against `eager`
// stepping on the same batches.
void train_with_batches_copied_ahead(TrainingRun& graphed, TrainingRun& eager, const Device& device,
                                     const std::function<std::vector<Tensor>()>& make_batch) {
  CapturedStep captured(device, [&](const std::vector<Tensor>& in) { graphed.step(in); });
  std::vector<Tensor> in = make_batch();
  for (int i = 0; i < 12; ++i) {
    const std::vector<Tensor> next = make_batch();
    captured.run(in, next);
    {
      DeviceGuard on_device(device);
      eager.step({prim::to(in[0], device), prim::to(in[1], device)});
    }
    in = next;
  }
  EXPECT_EQ(captured.captures(), 1);
  EXPECT_EQ(captured.fallback_reason(), "");
  expect_same_training(graphed, eager);
}

// run(batch, next): each batch is copied into the fixed inputs while the
// step before it runs, from where that step reads them no more. Every step
// starts with a millisecond of GPU work before its first read, so a copy
// that did not wait for the step's end (or its inputs_consumed()) would
// overwrite the inputs first and the parameters would leave the eager ones.
TEST(CudaGraph, BatchesCopiedAheadTrainLikeBatchesCopiedAtTheStep) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  for (const bool mark_consumed : {true, false})
    for (const bool on_gpu : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "inputs_consumed() " << mark_consumed << ", batches on the GPU " << on_gpu);
      TrainingRun graphed(seed), eager(seed);
      graphed.busy_before_reading = true;
      graphed.mark_consumed = mark_consumed;
      std::mt19937_64 rng(seed + 1);
      train_with_batches_copied_ahead(graphed, eager, kGPU, [&] {
        std::vector<Tensor> b = batch(rng, 48);
        if (on_gpu)
          for (Tensor& t : b) t = prim::to(t, kGPU);
        return b;
      });
    }
}

// A run on tensors other than those copied ahead copies its own; a run
// with new shapes after a copy ahead starts over with them.
TEST(CudaGraph, ARunOnOtherTensorsThanTheCopiedOnesUsesItsOwn) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  TrainingRun graphed(seed), eager(seed);
  graphed.mark_consumed = true;
  CapturedStep captured(kGPU, [&](const std::vector<Tensor>& in) { graphed.step(in); }, 2);
  std::mt19937_64 rng(seed + 1);
  for (int i = 0; i < 10; ++i) {
    const std::vector<Tensor> in = batch(rng, i < 6 ? 16 : 24);
    const std::vector<Tensor> unused = batch(rng, 16);  // announced, never run
    captured.run(in, unused);
    eager.step({prim::to(in[0], kGPU), prim::to(in[1], kGPU)});
  }
  EXPECT_EQ(captured.captures(), 2);
  expect_same_training(graphed, eager);
}

// As ReplicaGroup's replicas read their shares in mpt-bench's dp mode: a
// step on cuda:1 whose batches lie on cuda:0.
TEST(CudaGraph, BatchesCopiedAheadFromAnotherGpu) {
  MPT_SKIP_WITHOUT_CUDA();
  if (cuda_device_count() < 2) GTEST_SKIP() << "skipped: needs 2 CUDA devices";
  const Device second("cuda:1");
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  TrainingRun graphed(seed, 32, 64, second), eager(seed, 32, 64, second);
  graphed.busy_before_reading = graphed.mark_consumed = true;
  std::mt19937_64 rng(seed + 1);
  train_with_batches_copied_ahead(graphed, eager, second, [&] {
    std::vector<Tensor> b = batch(rng, 48);
    for (Tensor& t : b) t = prim::to(t, kGPU);
    return b;
  });
}

TEST(CudaGraph, StepThatSynchronizesFallsBackToEager) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  TrainingRun graphed(seed), eager(seed);
  graphed.read_loss_inside = eager.read_loss_inside = true;
  CapturedStep captured(kGPU, [&](const std::vector<Tensor>& in) { graphed.step(in); }, 1);
  std::mt19937_64 rng(seed + 1);
  for (int i = 0; i < 6; ++i) {
    const std::vector<Tensor> in = batch(rng, 16);
    captured.run(in);
    eager.step({prim::to(in[0], kGPU), prim::to(in[1], kGPU)});
  }
  EXPECT_FALSE(captured.captured());
  EXPECT_EQ(captured.replays(), 0);
  EXPECT_NE(captured.fallback_reason(), "");
  expect_same_training(graphed, eager);
}

// A capturable optimizer reads its learning rate and weight decay on the
// device: a schedule that sets the rate before every run takes effect in
// the replays without a new capture. The graphed steps train as eager
// steps of the same optimizer, and those as steps of a non-capturable one
// (rate passed from the host: the same rule with its bias corrections
// rounded elsewhere, which Adam's normalization of small gradients lifts to
// about 2e-4 at worst in 100 runs; a rate that stays at its first value is
// 0.2 to 0.4 off).
TEST(CudaGraph, ALearningRateSetBetweenReplaysTakesEffectWithoutCapturingAgain) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  TrainingRun graphed(seed), eager(seed), rate_from_host(seed);
  rate_from_host.opt->set_capturable(false);
  CapturedStep captured(kGPU, [&](const std::vector<Tensor>& in) { graphed.step(in); });
  std::mt19937_64 rng(seed + 1);
  const int steps = 20;
  for (int i = 0; i < steps; ++i) {
    const double lr = 1e-4 + 1e-2 * (1.0 + std::cos(0.3 * i)) / 2;  // a cosine, never twice the same
    for (TrainingRun* run : {&graphed, &eager, &rate_from_host}) run->opt->set_lr(lr);
    const std::vector<Tensor> in = batch(rng, 16);
    captured.run(in);
    const std::vector<Tensor> on_gpu = {prim::to(in[0], kGPU), prim::to(in[1], kGPU)};
    eager.step(on_gpu);
    rate_from_host.step(on_gpu);
  }
  EXPECT_EQ(captured.captures(), 1);
  EXPECT_EQ(captured.replays(), steps - 3);
  expect_same_training(graphed, eager);
  const auto pa = eager.model->parameters(), pb = rate_from_host.model->parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_LE(rel_error(host_f64(pa[i]), host_f64(pb[i])), 1e-2) << "parameter " << i;
  EXPECT_EQ(eager.scaler.get_scale(), rate_from_host.scaler.get_scale());
}

// Capturable SGD with momentum and dampening (whose first update differs
// from the later ones) under the same scaler and a schedule: the early
// steps overflow and are skipped on the device, including the first, so the
// first update that counts starts the momentum afresh inside the replays.
// Graphed, eager and non-capturable (rate from the host, skip decided
// there, buffer made at the first real update) steps train alike: SGD has
// no bias corrections to round differently.
TEST(CudaGraph, ReplayedSgdStepsFollowTheScalerAndTheScheduleAsEagerOnes) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const optim::SGDOptions options{.lr = 0.05, .momentum = 0.9, .dampening = 0.1, .weight_decay = 1e-3};
  TrainingRun graphed(seed), eager(seed), from_host(seed);
  for (TrainingRun* run : {&graphed, &eager, &from_host}) run->use_sgd(options);
  from_host.opt->set_capturable(false);
  CapturedStep captured(kGPU, [&](const std::vector<Tensor>& in) { graphed.step(in); });
  std::mt19937_64 rng(seed + 1);
  const int steps = 24;
  for (int i = 0; i < steps; ++i) {
    const double lr = 0.005 + 0.05 * (1.0 + std::cos(0.3 * i)) / 2;
    for (TrainingRun* run : {&graphed, &eager, &from_host}) run->opt->set_lr(lr);
    const std::vector<Tensor> in = batch(rng, 16);
    captured.run(in);
    const std::vector<Tensor> on_gpu = {prim::to(in[0], kGPU), prim::to(in[1], kGPU)};
    eager.step(on_gpu);
    from_host.step(on_gpu);
    if (i == 0) ASSERT_EQ(graphed.opt->step_count(0), 0) << "the first step should overflow at a scale of 2^24";
  }
  EXPECT_EQ(captured.captures(), 1);
  EXPECT_EQ(captured.replays(), steps - 3);
  expect_same_training(graphed, eager);
  expect_same_training(eager, from_host);
  // Updates happened inside the replays (the eager steps give at most 3).
  EXPECT_GT(graphed.opt->step_count(0), 3);
}

// Input shapes that change and come back (an epoch's short last batch, say)
// drop the graph and capture again each time. A dropped graph's memory
// goes back to the stream its replays ran on, and the next capture from
// that stream takes it: after the first round of shapes, no more memory is
// reserved, and training still follows the eager steps.
TEST(CudaGraph, ShapesThatComeBackCaptureIntoTheMemoryOfEarlierGraphs) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  TrainingRun graphed(seed, 32, 512), eager(seed, 32, 512);
  CapturedStep captured(kGPU, [&](const std::vector<Tensor>& in) { graphed.step(in); }, 1);
  std::mt19937_64 rng(seed + 1);
  uint64_t reserved_after_first_round = 0;
  const int rounds = 5;
  for (int round = 0; round < rounds; ++round) {
    for (const int64_t rows : {192, 320}) {
      for (int i = 0; i < 3; ++i) {
        const std::vector<Tensor> in = batch(rng, rows);
        captured.run(in);
        eager.step({prim::to(in[0], kGPU), prim::to(in[1], kGPU)});
      }
    }
    synchronize(kGPU);
    if (round == 0) reserved_after_first_round = memory_stats(kGPU).reserved_bytes;
  }
  EXPECT_EQ(captured.captures(), 2 * rounds);
  EXPECT_EQ(memory_stats(kGPU).reserved_bytes, reserved_after_first_round)
      << "each new capture reserved memory of its own";
  expect_same_training(graphed, eager);
}

// A graph replayed on another stream than the one it was captured from
// first waits for the work that stream had queued by the capture's end: the
// graph may write memory that work still reads (a block freed there, here
// during the capture, and taken by it).
TEST(CudaGraph, AReplayOnAnotherStreamWaitsForTheWorkQueuedBeforeTheCaptureEnded) {
  MPT_SKIP_WITHOUT_CUDA();
  const int64_t n = 1 << 22;
  const Stream origin = Stream::create(kGPU), other = Stream::create(kGPU);
  Tensor copied;
  cuda::Graph graph(0);
  {
    StreamGuard on_origin(origin);
    Tensor fives = full({n}, 5.0, DType::f32, kGPU);
    const void* freed = fives.data_ptr();
    graph.capture([&] {
      {
        StreamGuard eager_on_origin(origin);  // not captured: origin is not the capture's stream
        busy_gpu(kGPU, 4096);
        copied = prim::mul_scalar(fives, 1.0);  // reads the block behind the busy work
        fives = Tensor();
      }
      const Tensor nines = full({n}, 9.0, DType::f32, kGPU);
      EXPECT_EQ(nines.data_ptr(), freed) << "the capture did not take the block its stream freed";
    });
  }
  {
    StreamGuard on_other(other);
    graph.replay();
  }
  origin.synchronize();
  EXPECT_EQ(prim::amin(copied).item(), 5.0);
  EXPECT_EQ(prim::amax(copied).item(), 5.0);
}

// A graph's replay recorded into another graph's capture is refused: the
// other graph's replays would outlive this graph's memory. The graph still
// replays outside.
TEST(CudaGraph, AReplayInsideAnotherCaptureIsRefused) {
  MPT_SKIP_WITHOUT_CUDA();
  const Tensor x = full({64}, 1.0, DType::f32, kGPU);
  cuda::Graph inner(0), outer(0);
  inner.capture([&] { prim::copy_(x, prim::mul_scalar(x, 2.0)); });
  try {
    outer.capture([&] { inner.replay(); });
    ADD_FAILURE() << "the replay inside a capture was not refused";
  } catch (const ValueError& e) {
    testing::expect_contains(e.what(), {"cuda::Graph::replay", "captured into another graph"});
  }
  inner.replay();
  EXPECT_EQ(x.to_vector<double>(), std::vector<double>(64, 2.0));
}

// A dropped graph's tensors, cached or still held, belong to the stream its
// replays ran on: eager requests there get them, and nothing new is
// reserved.
TEST(CudaGraph, ADroppedGraphsMemoryServesEagerWorkOnTheStreamOfItsReplays) {
  MPT_SKIP_WITHOUT_CUDA();
  const int64_t n = 300001;  // a size class no other tensor here has
  const Stream replays = Stream::create(kGPU);
  StreamGuard on_replays(replays);
  const Tensor x = full({n}, 3.0, DType::f32, kGPU);
  Tensor out;
  {
    cuda::Graph graph(0);
    graph.capture([&] {
      const Tensor doubled = prim::mul_scalar(x, 2.0);  // freed back into the graph's pool
      out = prim::add_scalar(doubled, 1.0);             // held after the graph is gone
    });
    graph.replay();
    graph.replay();
  }
  EXPECT_EQ(out.to_vector<float>()[n - 1], 7.0f);
  const uint64_t mallocs = memory_stats(kGPU).num_device_mallocs;
  const Tensor first = full({n}, 1.0, DType::f32, kGPU);  // the pool's cached block
  const void* held = out.data_ptr();
  out = Tensor();
  const Tensor second = full({n}, 2.0, DType::f32, kGPU);
  EXPECT_EQ(second.data_ptr(), held);
  EXPECT_EQ(memory_stats(kGPU).num_device_mallocs, mallocs);
}

// Inside a capture, a block that a forked stream used (record_stream) is
// not handed out again before the capture ends: the graph has no edge that
// orders that stream's reads before a new tensor's writes.
TEST(CudaGraph, ABlockAForkedStreamUsedWaitsForTheEndOfTheCapture) {
  MPT_SKIP_WITHOUT_CUDA();
  const int64_t n = 300007;  // a size class no other tensor here has
  const Stream side = Stream::create(kGPU);
  const Tensor x = full({n}, 3.0, DType::f32, kGPU);
  Tensor read_on_side, after;
  const void* used_on_side = nullptr;
  const void* taken_after = nullptr;
  cuda::Graph graph(0);
  graph.capture([&] {
    const Stream main = current_stream(kGPU);  // the capturing stream
    Tensor t = prim::mul_scalar(x, 2.0);
    used_on_side = t.data_ptr();
    Event forked(kGPU);
    forked.record(main);
    forked.wait(side);
    {
      StreamGuard on_side(side);
      read_on_side = prim::add_scalar(t, 1.0);
    }
    record_stream(t.data_ptr(), side);
    t = Tensor();
    after = prim::mul_scalar(x, 5.0);
    taken_after = after.data_ptr();
    Event joined(kGPU);
    joined.record(side);
    joined.wait(main);
  });
  EXPECT_NE(taken_after, used_on_side);
  graph.replay();
  EXPECT_EQ(read_on_side.to_vector<float>()[n - 1], 7.0f);
  EXPECT_EQ(after.to_vector<float>()[n - 1], 15.0f);
}

// A tensor of the shared cache that the capture's stream used (record_stream)
// may be freed inside the capture. It is parked only once the capture has
// ended: an event recorded on the capturing stream would join the graph and
// could never be queried, failing every allocation after the capture.
TEST(CudaGraph, AnOlderTensorUsedInTheCaptureMayBeFreedThere) {
  MPT_SKIP_WITHOUT_CUDA();
  const int64_t n = 300013;  // a size class no other tensor here has
  Tensor x = full({n}, 3.0, DType::f32, kGPU);
  const void* x_block = x.data_ptr();
  const Tensor input = full({64}, 1.0, DType::f32, kGPU);
  Tensor out;
  cuda::Graph graph(0);
  graph.capture([&] {
    record_stream(x.data_ptr(), current_stream(kGPU));  // as a read of x on the capturing stream does
    x = Tensor();
    out = prim::mul_scalar(input, 2.0);
  });
  graph.replay();
  EXPECT_EQ(out.to_vector<float>()[63], 2.0f);
  synchronize(kGPU);
  const Tensor again = full({n}, 4.0, DType::f32, kGPU);
  EXPECT_EQ(again.data_ptr(), x_block);  // parked at the capture's end, free once that stream passed
  EXPECT_EQ(again.to_vector<float>()[n - 1], 4.0f);
}

// A pinned block that a captured copy reads is read again at every replay:
// it is never handed out again, and the replays copy what it held.
TEST(CudaGraph, APinnedBlockACapturedCopyReadsIsNotHandedOutAgain) {
  MPT_SKIP_WITHOUT_CUDA();
  const int64_t n = 4099;
  Tensor pinned = pin_memory(full({n}, 5.0));
  const void* block = pinned.data_ptr();
  Tensor on_gpu;
  cuda::Graph graph(0);
  graph.capture([&] { on_gpu = prim::to(pinned, kGPU); });
  pinned = Tensor();
  const Tensor other = pin_memory(full({n}, 9.0));
  EXPECT_NE(other.data_ptr(), block);
  graph.replay();
  EXPECT_EQ(on_gpu.to_vector<float>()[n - 1], 5.0f);
}

// What a collective registers while its step is captured: called around
// every replay of that graph, once however often it was registered.
struct CountingWatch : cuda::ReplayWatch {
  int before = 0, launched = 0;
  bool refuse = false;
  void before_replay() override {
    ++before;
    if (refuse) throw Refused("an earlier replay failed");
  }
  void replay_launched(int device) override {
    EXPECT_EQ(device, 0);
    ++launched;
  }
  bool replays_abandoned() const override { return false; }
  struct Refused : Error {
    using Error::Error;
  };
};

TEST(CudaGraph, ReplayWatchesRegisteredDuringTheCaptureFrameEveryReplay) {
  MPT_SKIP_WITHOUT_CUDA();
  auto watch = std::make_shared<CountingWatch>();
  auto ignored = std::make_shared<CountingWatch>();
  cuda::watch_replays(ignored);  // outside a capture: nothing to watch
  Tensor x = full({64}, 1.0, DType::f32, kGPU);
  CapturedStep captured(
      kGPU,
      [&](const std::vector<Tensor>&) {
        cuda::watch_replays(watch);
        prim::copy_(x, prim::mul_scalar(x, 2.0));
        cuda::watch_replays(watch);
      },
      1);
  for (int i = 0; i < 4; ++i) captured.run();  // eager, then captured and replayed 3 times
  EXPECT_EQ(captured.replays(), 3);
  EXPECT_EQ(watch->before, 3);
  EXPECT_EQ(watch->launched, 3);
  EXPECT_EQ(ignored->before + ignored->launched, 0);
  EXPECT_EQ(x.to_vector<double>().front(), 16.0);

  // A watch that refuses stops the replay before it is launched.
  watch->refuse = true;
  EXPECT_THROW(captured.run(), CountingWatch::Refused);
  EXPECT_EQ(watch->launched, 3);
  EXPECT_EQ(captured.replays(), 3);
  EXPECT_EQ(x.to_vector<double>().front(), 16.0);
}

// The GPU timer's stamps follow the work between them, in a replayed graph
// as in an eager step; a stamp for another device is not this timeline's.
TEST(GpuTimeline, StampsBracketTheWorkBetweenThemInReplays) {
  MPT_SKIP_WITHOUT_CUDA();
  GpuTimeline timeline(kGPU);
  GpuTimeline::Activation active(&timeline);
  const Tensor a = full({1024, 1024}, 0.001, DType::f32, kGPU);
  CapturedStep captured(
      kGPU,
      [&](const std::vector<Tensor>&) {
        timeline.begin_step();
        gpu_stamp(kGPU, "before");
        Tensor y = a;
        for (int i = 0; i < 16; ++i) y = prim::matmul(y, a);
        gpu_stamp(Device(DeviceType::cuda, 1), "another GPU");
        gpu_stamp(kGPU, "after");
      },
      1);
  for (int i = 0; i < 3; ++i) captured.run();  // eager, then captured and replayed twice
  EXPECT_EQ(captured.replays(), 2);
  const auto stamps = timeline.read();
  ASSERT_EQ(stamps.size(), 2u);
  EXPECT_EQ(stamps[0], (std::pair<std::string, double>{"before", 0.0}));
  EXPECT_EQ(stamps[1].first, "after");
  EXPECT_GT(stamps[1].second, 0.0);
  EXPECT_LT(stamps[1].second, 1e6);  // microseconds: 16 small matmuls take well under a second
}

// Timing convolution algorithms runs kernels and synchronizes, which a
// capture forbids: a geometry first seen inside a capture takes cuDNN's
// heuristic pick there, and the graph computes what the eager (timed) call
// computes and what the CPU does.
TEST(CudaGraph, AConvolutionFirstSeenInACaptureRecordsWithoutTiming) {
  MPT_SKIP_WITHOUT_CUDA();
  cuda::set_conv_autotune(true);
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  // A geometry no other test uses, so no plan for it is cached yet.
  const Tensor x_cpu = randn({3, 5, 13, 11}, DType::f32, kCPU, &gen), w_cpu = randn({7, 5, 3, 2}, DType::f32, kCPU, &gen);
  const Tensor x = prim::to(x_cpu, kGPU), w = prim::to(w_cpu, kGPU);
  const Conv2dParams p{1, 2, 1, 0};
  // cuDNN itself is set up by an eager convolution first (its handle is
  // made outside any capture in a CapturedStep's eager steps as well).
  (void)conv2d(x, w, Tensor(), Conv2dParams{});
  Tensor graphed;
  cuda::Graph graph(0);
  graph.capture([&] { graphed = conv2d(x, w, Tensor(), p); });
  graph.replay();
  const Tensor eager = conv2d(x, w, Tensor(), p);
  EXPECT_LE(rel_error(host_f64(graphed), host_f64(eager)), 1e-5);
  EXPECT_LE(rel_error(host_f64(graphed), host_f64(conv2d(x_cpu, w_cpu, Tensor(), p))), 1e-5);
  cuda::set_conv_autotune(false);
}

TEST(CudaIndexCheck, BadIndexIsReportedAtTheNextSynchronization) {
  MPT_SKIP_WITHOUT_CUDA();
  const Tensor table = randn({5, 4}, DType::f32, kGPU);
  const Tensor bad = prim::to(from_vector(std::vector<int64_t>{0, 7, 2}, {3}, DType::i64), kGPU);
  const Tensor rows = embedding(table, bad);  // no host wait here
  testing::expect_contains(testing::error_of<ValueError>([&] { (void)rows.to_vector<float>(); }),
                           {"embedding: index 7 is out of range [0, 5)", "cuda:0"});
  // Reported once; the row it would have read is zeros, nothing outside the table.
  const std::vector<float> got = rows.to_vector<float>();
  for (int j = 4; j < 8; ++j) EXPECT_EQ(got[j], 0.0f);
  const Tensor logits = randn({3, 10}, DType::f16, kGPU);
  const Tensor target = prim::to(from_vector(std::vector<int64_t>{1, -100, 12}, {3}, DType::i64), kGPU);
  const Tensor loss = cross_entropy(logits, target, -100);
  testing::expect_contains(testing::error_of<ValueError>([&] { (void)loss.item(); }),
                           {"cross_entropy: index 12 is out of range [0, 10)", "ignore_index is -100"});
  // Good indices afterwards: no error left behind.
  const Tensor good = prim::to(from_vector(std::vector<int64_t>{4, -100, 9}, {3}, DType::i64), kGPU);
  EXPECT_TRUE(std::isfinite(cross_entropy(logits, good, -100).item()));
}

}  // namespace
}  // namespace mpt
