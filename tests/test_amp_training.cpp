// Mixed precision end to end on the CPU, where f16 is a real storage type:
// a real f16 overflow is skipped without touching the weights and training
// recovers; f16 autocast + loss scaling trains an MLP as well as f32 does.
#include <gtest/gtest.h>

#include <cmath>

#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "autograd/ops.h"
#include "models/layers.h"
#include "models/sequential.h"
#include "models/sgd.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

struct Problem {
  Tensor x, y;
};

// y = sin(x W) summed: smooth, learnable by a small MLP.
Problem make_problem(uint64_t seed) {
  Generator gen(seed);
  Problem p;
  p.x = randn({64, 8}, DType::f32, kCPU, &gen);
  const Tensor w = randn({8, 1}, DType::f32, kCPU, &gen);
  p.y = prim::unary(UnaryOp::sin, prim::matmul(p.x, w));
  return p;
}

std::unique_ptr<nn::Sequential> make_mlp(uint64_t seed) {
  Generator gen(seed);
  auto net = std::make_unique<nn::Sequential>();
  net->push_back(std::make_shared<nn::Linear>(8, 32, true, &gen));
  net->push_back(std::make_shared<nn::ReLU>());
  net->push_back(std::make_shared<nn::Linear>(32, 1, true, &gen));
  net->named_parameters();  // stamps parameter names
  return net;
}

double loss_f32(nn::Sequential& net, const Problem& p) {
  NoGradGuard no_grad;
  return mse_loss(net(p.x), p.y).item();
}

std::vector<std::vector<float>> snapshot(nn::Module& net) {
  std::vector<std::vector<float>> out;
  for (const Tensor& t : net.parameters()) out.push_back(t.to_vector<float>());
  return out;
}

TEST(AmpTraining, F16OverflowIsSkippedWithWeightsUntouchedAndTrainingRecovers) {
  const Problem p = make_problem(1);
  auto net = make_mlp(2);
  optim::SGD opt(net->parameters(), {.lr = 0.05});
  amp::GradScalerOptions o;
  o.init_scale = std::ldexp(1.0, 40);  // far too large: f16 gradients overflow
  o.growth_interval = 1000;
  amp::GradScaler scaler(o);
  std::vector<std::string> warnings;
  scaler.set_warning_sink([&](const std::string& w) { warnings.push_back(w); });
  const double initial = loss_f32(*net, p);

  int skipped = 0;
  for (int step = 0; step < 150; ++step) {
    net->zero_grad();
    Tensor loss;
    {
      amp::AutocastGuard autocast(DeviceType::cpu, DType::f16);
      loss = mse_loss(net->forward(p.x), p.y);
    }
    backward(scaler.scale(loss));
    const auto before = snapshot(*net);
    const double scale_before = scaler.get_scale();
    scaler.step(opt);
    scaler.update();
    const bool was_skipped = scaler.get_scale() < scale_before;
    if (step == 0) {
      ASSERT_TRUE(was_skipped) << "a scale of 2^40 must overflow the f16 gradients";
      ASSERT_EQ(opt.state(0).step, 0);
    }
    if (was_skipped) {
      ++skipped;
      EXPECT_EQ(snapshot(*net), before) << "step " << step << ": a skipped step changed the weights";
      EXPECT_EQ(scaler.get_scale(), scale_before / 2);
    }
  }
  EXPECT_GE(skipped, 20);  // 2^40 -> below the f16 limit takes many halvings
  EXPECT_LE(skipped, 40);
  EXPECT_TRUE(warnings.empty());  // the scale never collapsed below 1
  const double final_loss = loss_f32(*net, p);
  EXPECT_LT(final_loss, 0.5 * initial) << "training did not recover after the overflows";
}

TEST(AmpTraining, F16AutocastWithScalerMatchesF32Training) {
  const Problem p = make_problem(3);
  auto net32 = make_mlp(4);
  auto net16 = make_mlp(4);
  optim::SGD opt32(net32->parameters(), {.lr = 0.05});
  optim::SGD opt16(net16->parameters(), {.lr = 0.05});
  amp::GradScalerOptions o;
  o.growth_interval = 50;
  amp::GradScaler scaler(o);
  const double initial = loss_f32(*net32, p);
  for (int step = 0; step < 300; ++step) {
    net32->zero_grad();
    backward(mse_loss(net32->forward(p.x), p.y));
    opt32.step();

    net16->zero_grad();
    Tensor loss;
    {
      amp::AutocastGuard autocast(DeviceType::cpu, DType::f16);
      loss = mse_loss(net16->forward(p.x), p.y);
    }
    backward(scaler.scale(loss));
    scaler.step(opt16);
    scaler.update();
  }
  for (const Tensor& w : net16->parameters()) EXPECT_EQ(w.dtype(), DType::f32);  // master weights stay f32
  const double l32 = loss_f32(*net32, p), l16 = loss_f32(*net16, p);
  EXPECT_LT(l32, 0.3 * initial);
  EXPECT_NEAR(l16, l32, 0.03 * initial) << "f32 " << l32 << " f16 " << l16 << " initial " << initial;
}

}  // namespace
}  // namespace mpt
