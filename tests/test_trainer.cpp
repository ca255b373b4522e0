// train::Trainer, the step and loop every tool drives, on the CPU: its
// steps are the written rule (a hand-written loop of the same micro-batches
// ends with the same weights, bit for bit), a run stopped and restored from
// its checkpoint ends as an unbroken one, a stop request ends fit() after
// the current step with a checkpoint, clipping on the device is the
// host's, the loss scaler runs where LossScaling says, and options that
// cannot work are refused by name.
#include <gtest/gtest.h>

#include <random>

#include "autograd/engine.h"
#include "autograd/ops.h"
#include "models/adamw.h"
#include "models/clip_grad.h"
#include "models/mlp.h"
#include "models/sampler.h"
#include "tests/test_util.h"
#include "train/trainer.h"

namespace mpt::train {
namespace {

// 96 samples of 12 features in 3 classes (the class is the largest of the
// first three features).
class Blobs : public data::Dataset {
 public:
  explicit Blobs(int64_t features = 12) {
    Generator gen(3);
    x_ = randn({96, features}, DType::f32, kCPU, &gen);
    const std::vector<float> v = x_.to_vector<float>();
    std::vector<int64_t> y;
    for (int i = 0; i < 96; ++i) {
      const float* r = &v[static_cast<size_t>(i * features)];
      y.push_back(r[0] > r[1] ? (r[0] > r[2] ? 0 : 2) : (r[1] > r[2] ? 1 : 2));
    }
    y_ = from_vector(y, {96}, DType::i64);
  }
  int64_t size() const override { return 96; }
  data::Batch get_batch(const std::vector<int64_t>& indices) const override {
    const Tensor idx = from_vector(indices, {static_cast<int64_t>(indices.size())}, DType::i64);
    return {prim::index_select_rows(x_, idx), prim::reshape(prim::index_select_rows(prim::reshape(y_, {96, 1}), idx), {-1})};
  }

 private:
  Tensor x_, y_;
};

std::shared_ptr<nn::Module> small_mlp() {
  Generator gen(11);
  return nn::make_mlp({.in_features = 12, .hidden = {16}, .num_classes = 3}, &gen);
}

std::vector<double> weights_of(nn::Module& m) {
  std::vector<double> out;
  for (const Tensor& p : m.parameters())
    for (double v : p.to_vector<double>()) out.push_back(v);
  return out;
}

data::DataLoader loader_for(const std::shared_ptr<Blobs>& data, int64_t batch) {
  return data::DataLoader(data, std::make_shared<data::SequentialOrRandomSampler>(data->size(), true, 5),
                          {.batch_size = batch, .num_workers = 0});
}

std::unique_ptr<Trainer> trainer_for(std::shared_ptr<nn::Module> model, TrainerOptions options = {}) {
  return std::make_unique<Trainer>(model, std::make_unique<optim::AdamW>(model->parameters(), optim::AdamWOptions{.lr = 1e-2}),
                                   classification(), options);
}

TEST(Trainer, AStepOfMicroBatchesIsTheWrittenRule) {
  auto data = std::make_shared<Blobs>();
  const data::Batch a = data->get_batch({0, 1, 2, 3, 4, 5, 6, 7}), b = data->get_batch({8, 9, 10, 11, 12, 13, 14, 15});
  auto model = small_mlp();
  auto trainer = trainer_for(model);
  for (int s = 0; s < 3; ++s) trainer->step({a, b});

  // By hand: each micro-batch's mean loss weighted by 1/2, one AdamW step.
  auto by_hand = small_mlp();
  optim::AdamW opt(by_hand->parameters(), optim::AdamWOptions{.lr = 1e-2});
  double last_loss = 0;
  for (int s = 0; s < 3; ++s) {
    opt.zero_grad();
    last_loss = 0;
    for (const data::Batch* m : {&a, &b}) {
      const Tensor loss = cross_entropy(by_hand->forward(m->input), m->target);
      backward(loss * 0.5);
      last_loss += 0.5 * loss.item();
    }
    opt.step();
  }
  EXPECT_EQ(weights_of(*model), weights_of(*by_hand));
  const StepMetrics m = trainer->metrics();
  EXPECT_EQ(m.step, 3);
  EXPECT_DOUBLE_EQ(m.loss, last_loss);
  EXPECT_EQ(m.skipped_steps, 0);
  EXPECT_EQ(m.samples, 48);
}

TEST(Trainer, ARunRestoredFromItsCheckpointEndsAsAnUnbrokenOne) {
  testing::TempDir dir("trainer-test");
  auto data = std::make_shared<Blobs>();
  TrainerOptions o;
  o.step.precision = Precision::bf16;
  o.schedule = optim::LrSchedule::cosine(1e-2, 2, 12);
  const FitOptions fit{.epochs = 3, .accumulation = 2, .log_every = 4};

  auto whole = small_mlp();
  auto loader = loader_for(data, 8);
  trainer_for(whole, o)->fit(loader, fit);

  auto part = small_mlp();
  {
    auto first = trainer_for(part, o);
    auto first_loader = loader_for(data, 8);
    FitOptions stop = fit;
    stop.stop_after = 5;  // in the middle of the second epoch
    stop.checkpoint = dir.file("c.safetensors");
    const FitResult r = first->fit(first_loader, stop);
    EXPECT_FALSE(r.finished);
    EXPECT_EQ(r.steps, 5);
  }
  auto resumed = small_mlp();  // other weights until restored
  auto second = trainer_for(resumed, o);
  second->restore(ckpt::read_checkpoint(dir.file("c.safetensors")));
  EXPECT_EQ(second->steps(), 5);
  auto second_loader = loader_for(data, 8);
  const FitResult r = second->fit(second_loader, fit);
  EXPECT_TRUE(r.finished);
  EXPECT_EQ(r.steps, 18);  // 12 batches an epoch, 2 to a step, 3 epochs
  EXPECT_EQ(weights_of(*resumed), weights_of(*whole));
}

// fp8: the hidden layer's products in FP8 (sizes of 16), the head in bf16.
// A run restored from its checkpoint (weights, optimizer and the FP8
// scales and amax histories) ends as an unbroken one, bit for bit.
TEST(Trainer, AnFp8RunRestoredFromItsCheckpointEndsAsAnUnbrokenOne) {
  testing::TempDir dir("trainer-fp8-test");
  auto data = std::make_shared<Blobs>(16);
  auto fp8_mlp = [] {
    Generator gen(11);
    return nn::make_mlp({.in_features = 16, .hidden = {32}, .num_classes = 3}, &gen);
  };
  TrainerOptions o;
  o.step.precision = Precision::fp8;
  o.step.fp8.history_length = 4;
  const FitOptions fit{.epochs = 3, .accumulation = 2, .log_every = 4};

  auto whole = fp8_mlp();
  auto loader = loader_for(data, 16);
  auto whole_trainer = trainer_for(whole, o);
  whole_trainer->fit(loader, fit);
  // The FP8 layer ran: its input's, weight's and gradient's amaxes entered
  // the histories.
  amp::Fp8Scaling* scaling = whole_trainer->precision().fp8_scaling();
  ASSERT_NE(scaling, nullptr);
  ASSERT_EQ(scaling->slots(amp::Fp8Group::forward), 2);
  for (amp::Fp8Group g : {amp::Fp8Group::forward, amp::Fp8Group::backward})
    for (float amax : scaling->history(g).to_vector<float>()) EXPECT_GT(amax, 0.0f);
  EXPECT_NE(scaling->scale(amp::Fp8Group::backward).to_vector<float>()[0], 1.0f);

  auto part = fp8_mlp();
  {
    auto first = trainer_for(part, o);
    auto first_loader = loader_for(data, 16);
    FitOptions stop = fit;
    stop.stop_after = 4;  // in the middle of the second epoch
    stop.checkpoint = dir.file("c.safetensors");
    EXPECT_FALSE(first->fit(first_loader, stop).finished);
  }
  auto resumed = fp8_mlp();
  auto second = trainer_for(resumed, o);
  second->restore(ckpt::read_checkpoint(dir.file("c.safetensors")));
  auto second_loader = loader_for(data, 16);
  EXPECT_TRUE(second->fit(second_loader, fit).finished);
  EXPECT_EQ(weights_of(*resumed), weights_of(*whole));
  for (size_t i = 0; i < scaling->state().size(); ++i)
    EXPECT_EQ(second->precision().fp8_scaling()->state()[i].second.to_vector<double>(),
              scaling->state()[i].second.to_vector<double>())
        << scaling->state()[i].first;

  // Not into a run of another precision, and nothing of it changes.
  TrainerOptions bf16 = o;
  bf16.step.precision = Precision::bf16;
  auto other = fp8_mlp();
  const std::vector<double> before = weights_of(*other);
  testing::expect_contains(testing::error_of<ValueError>([&] {
                             trainer_for(other, bf16)->restore(ckpt::read_checkpoint(dir.file("c.safetensors")));
                           }),
                           {"FP8 scaling state", "not fp8"});
  EXPECT_EQ(weights_of(*other), before);
}

TEST(Trainer, AStopRequestEndsTheRunAfterTheStepWithACheckpoint) {
  testing::TempDir dir("trainer-test");
  auto data = std::make_shared<Blobs>();
  auto trainer = trainer_for(small_mlp());
  auto loader = loader_for(data, 8);
  std::vector<int64_t> logged;
  FitCallbacks callbacks;
  callbacks.on_log = [&](const StepMetrics& m) { logged.push_back(m.step); };
  callbacks.stop_requested = [&] { return trainer->steps() >= 7; };
  const FitResult r =
      trainer->fit(loader, {.epochs = 2, .log_every = 3, .checkpoint = dir.file("s.safetensors")}, callbacks);
  EXPECT_TRUE(r.stopped);
  EXPECT_FALSE(r.finished);
  EXPECT_EQ(r.steps, 7);
  EXPECT_EQ(logged, (std::vector<int64_t>{3, 6}));
  const ckpt::Checkpoint saved = ckpt::read_checkpoint(dir.file("s.safetensors"));
  EXPECT_EQ(saved.step, 7);
  EXPECT_EQ(saved.position.batch, 7);
}

TEST(Trainer, ClippingOnTheDeviceIsTheHostsRule) {
  for (const double max_norm : {0.05, 1e6}) {
    std::vector<Tensor> a, b;
    Generator gen(9);
    for (const Shape& s : {Shape{4, 5}, Shape{7}}) {
      Tensor g = prim::mul_scalar(randn(s, DType::f32, kCPU, &gen), 3.0);
      Tensor p1 = zeros(s), p2 = zeros(s);
      p1.set_grad(prim::clone(g));
      p2.set_grad(prim::clone(g));
      a.push_back(p1);
      b.push_back(p2);
    }
    const double total = nn::clip_grad_norm_(a, max_norm);
    const Tensor on_device = nn::clip_grad_norm_on_device_(b, max_norm);
    EXPECT_FLOAT_EQ(static_cast<float>(on_device.item()), static_cast<float>(total));
    for (size_t i = 0; i < a.size(); ++i) {
      const std::vector<float> x = a[i].grad().to_vector<float>(), y = b[i].grad().to_vector<float>();
      for (size_t k = 0; k < x.size(); ++k) EXPECT_NEAR(y[k], x[k], 1e-6f * std::abs(x[k]) + 1e-12f);
    }
  }
  // A non-finite norm leaves a NaN among the gradients (the coefficient is
  // 0, and inf * 0 is NaN), as PyTorch's does, for the loss scaler to see.
  Tensor p = zeros({3}), q = zeros({3});
  const std::vector<float> with_inf{1.0f, std::numeric_limits<float>::infinity(), 2.0f};
  p.set_grad(from_vector(with_inf, {3}));
  q.set_grad(from_vector(with_inf, {3}));
  EXPECT_TRUE(std::isinf(nn::clip_grad_norm_on_device_({p}, 1.0).item()));
  nn::clip_grad_norm_({q}, 1.0);
  const std::vector<float> device = p.grad().to_vector<float>(), host = q.grad().to_vector<float>();
  EXPECT_TRUE(std::isnan(device[1]));
  EXPECT_EQ(device[0], host[0]);
  EXPECT_EQ(device[2], host[2]);
  EXPECT_TRUE(std::isnan(host[1]));
}

TEST(Trainer, TheLossScalerRunsWhereLossScalingSays) {
  for (const auto& [precision, scaling, scaled] :
       {std::tuple{Precision::fp16, LossScaling::automatic, true}, {Precision::bf16, LossScaling::automatic, false},
        {Precision::bf16, LossScaling::always, true}, {Precision::fp16, LossScaling::never, false},
        {Precision::fp32, LossScaling::automatic, false}}) {
    TrainerOptions o;
    o.step.precision = precision;
    o.step.loss_scaling = scaling;
    auto trainer = trainer_for(small_mlp(), o);
    EXPECT_EQ(trainer->precision().scaler() != nullptr, scaled) << precision_name(precision);
  }
}

TEST(Trainer, OptionsThatCannotWorkAreRefusedByName) {
  TrainerOptions ddp;
  ddp.parallel = Parallel::ddp;
  testing::expect_contains(testing::error_of<ValueError>([&] { trainer_for(small_mlp(), ddp); }),
                           {"Parallel::ddp needs a process group"});
  TrainerOptions graph;
  graph.step.cuda_graph = GraphMode::on;
  testing::expect_contains(testing::error_of<ValueError>([&] { trainer_for(small_mlp(), graph); }),
                           {"cannot be a CUDA graph", "the run is on cpu, not a GPU"});
  TrainerOptions clip;
  clip.step.max_grad_norm = -1;
  testing::expect_contains(testing::error_of<ValueError>([&] { trainer_for(small_mlp(), clip); }),
                           {"max_grad_norm must be finite and not negative"});
  EXPECT_THROW(precision_from_name("fp4"), ValueError);
  TrainerOptions fp8;
  fp8.step.precision = Precision::fp8;
  fp8.step.fp8.history_length = 0;
  testing::expect_contains(testing::error_of<ValueError>([&] { trainer_for(small_mlp(), fp8); }),
                           {"history length must be at least 1"});
  EXPECT_EQ(planned_steps(12, 3, 5), 9);  // 12 batches: steps of 5, 5 and 2
  EXPECT_EQ(planned_steps(12, 3, 5, 4), 4);
}

}  // namespace
}  // namespace mpt::train
