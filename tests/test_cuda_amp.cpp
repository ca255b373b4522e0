// The scaler's CUDA kernels against the CPU: the fused unscale + inf check
// bit for bit over many tensors of odd sizes and alignments, found_inf from
// a single inf/NaN anywhere, and the on-device scale update.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <set>

#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "amp/unscale.h"
#include "autograd/engine.h"
#include "autograd/ops.h"
#include "models/layers.h"
#include "models/sequential.h"
#include "models/sgd.h"
#include "tensor/memory.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

const Device kGPU{DeviceType::cuda, 0};

// Contiguous tensors of odd sizes; some start 1..7 elements into a buffer,
// so their data is not 16-byte aligned.
std::vector<Tensor> odd_tensors(DType dtype, const Device& device, uint64_t seed) {
  std::vector<Tensor> out;
  Generator gen(seed);
  const int64_t sizes[] = {1, 3, 7, 8, 17, 255, 1000, 4099, 65535, 65537, 200003};
  for (int64_t n : sizes)
    for (int64_t shift : {0, 1, 3, 7}) {
      const Tensor values = prim::mul_scalar(randn({n + shift}, DType::f32, kCPU, &gen), 1000.0);
      const Tensor buffer = prim::to(prim::to(values, dtype), device);
      out.push_back(prim::slice(buffer, 0, shift, n + shift));  // contiguous, shifted start
    }
  return out;
}

std::vector<Tensor> to_cpu(const std::vector<Tensor>& ts) {
  std::vector<Tensor> out;
  for (const Tensor& t : ts) out.push_back(prim::clone(prim::to(t, kCPU)));
  return out;
}

// On the GPU the weights cast ahead go through one multi-tensor launch (odd
// sizes, so slots and tails are not all whole 16-byte packs): the output
// and every gradient are the same bits as with the ops' own casts.
TEST(CudaAmp, WeightsCastAheadAreTheOpsOwnCastsBitForBit) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  auto run = [seed](bool ahead) {
    Generator gen(seed);
    std::vector<Tensor> params;
    for (auto [out, in] : {std::pair{37, 29}, {53, 37}, {11, 53}}) {
      params.push_back(randn({out, in}, DType::f32, kGPU, &gen).set_requires_grad(true));
      params.push_back(randn({out}, DType::f32, kGPU, &gen).set_requires_grad(true));
    }
    Tensor h = randn({64, 29}, DType::f32, kGPU, &gen);
    {
      amp::AutocastGuard autocast(DeviceType::cuda, DType::f16);
      if (ahead) amp::cast_weights_ahead(params);
      for (size_t i = 0; i < params.size(); i += 2) h = gelu(linear(h, params[i], params[i + 1]));
    }
    backward(sum(to(h, DType::f32)));
    std::vector<std::vector<double>> out{h.to_vector<double>()};
    for (const Tensor& p : params) out.push_back(p.grad().to_vector<double>());
    return out;
  };
  EXPECT_EQ(run(true), run(false));
}

// On the GPU cross_entropy reads 16-bit logits in its fused kernels: the
// loss and gradient agree with the f32 copy PyTorch would make (to the
// rounding of the 16-bit gradient), and no f32 copy of the logits is made.
TEST(CudaAmp, CrossEntropyReads16BitLogitsWithoutAnF32Copy) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  const int64_t rows = 512, vocab = 50257;
  const Tensor target = prim::to(
      prim::to(rand({rows}, DType::f32, kCPU, &gen, 0.0, static_cast<double>(vocab) - 0.5), DType::i64), kGPU);
  for (DType low : {DType::f16, DType::bf16}) {
    SCOPED_TRACE(dtype_name(low));
    Tensor logits = randn({rows, vocab}, low, kGPU, &gen);
    logits.set_requires_grad(true);
    synchronize(kGPU);
    reset_peak_memory_stats(kGPU);
    const uint64_t before = memory_stats(kGPU).allocated_bytes;
    Tensor as_is;
    {
      amp::AutocastGuard autocast(DeviceType::cuda, low);
      as_is = cross_entropy(logits, target);
    }
    backward(as_is);
    // The gradient (16-bit, as large as the logits), a few scalars per row
    // and the allocator's rounding; an f32 copy would add twice the logits.
    EXPECT_LT(memory_stats(kGPU).peak_allocated_bytes - before, logits.nbytes() + (uint64_t(4) << 20));
    const Tensor grad_as_is = logits.grad();
    logits.set_grad(Tensor());
    const Tensor copied = cross_entropy(to(logits, DType::f32), target);
    backward(copied);
    EXPECT_EQ(grad_as_is.dtype(), low);
    EXPECT_NEAR(as_is.item(), copied.item(), 1e-5 * std::abs(copied.item()));
    const std::vector<float> a = grad_as_is.to_vector<float>(), b = logits.grad().to_vector<float>();
    // One unit in the last place apart at most (the row's log-sum-exp may
    // differ in its last f32 bit); f16's subnormals are 6e-8 apart.
    const double ulp = low == DType::f16 ? 1.0 / 1024 : 1.0 / 128, tiny = low == DType::f16 ? 6e-8 : 1e-30;
    size_t beyond = 0;
    for (size_t i = 0; i < a.size(); ++i)
      if (std::abs(a[i] - b[i]) > ulp * std::abs(b[i]) + tiny) ++beyond;
    EXPECT_EQ(beyond, 0u);
  }
}

TEST(CudaAmp, FusedUnscaleEqualsTheCpuBitForBit) {
  MPT_SKIP_WITHOUT_CUDA();
  for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dtype));
    std::vector<Tensor> gpu = odd_tensors(dtype, kGPU, 7);
    std::vector<Tensor> cpu = to_cpu(gpu);
    Tensor found_gpu = zeros({1}, DType::f32, kGPU), found_cpu = zeros({1});
    const double inv = 1.0 / 3.0;  // not a power of two: rounding must agree
    amp::unscale_and_check_inf_(gpu, found_gpu, full({1}, inv, DType::f32, kGPU));
    amp::unscale_and_check_inf_(cpu, found_cpu, full({1}, inv));
    EXPECT_EQ(found_gpu.item(), 0.0);
    EXPECT_EQ(found_cpu.item(), 0.0);
    for (size_t i = 0; i < gpu.size(); ++i) {
      const auto a = prim::to(gpu[i], DType::f32).to_vector<float>();
      const auto b = prim::to(cpu[i], DType::f32).to_vector<float>();
      ASSERT_EQ(a, b) << "tensor " << i << " of " << gpu[i].numel();
    }
  }
}

TEST(CudaAmp, ASingleInfOrNanAnywhereRaisesFoundInf) {
  MPT_SKIP_WITHOUT_CUDA();
  for (DType dtype : {DType::f32, DType::f16, DType::bf16})
    for (double bad : {std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                       std::numeric_limits<double>::quiet_NaN()})
      for (size_t which : {size_t{0}, size_t{13}, size_t{43}}) {
        std::vector<Tensor> grads = odd_tensors(dtype, kGPU, 9);
        Tensor& t = grads[which];
        const int64_t at = t.numel() - 1;  // the last element: the scalar tail of the kernel
        prim::fill_(prim::slice(t, 0, at, at + 1), bad);
        Tensor found = zeros({1}, DType::f32, kGPU);
        amp::unscale_and_check_inf_(grads, found, full({1}, 0.5, DType::f32, kGPU));
        EXPECT_EQ(found.item(), 1.0) << dtype_name(dtype) << " tensor " << which << " value " << bad;
        // and in the first element: the vectorised body
        grads = odd_tensors(dtype, kGPU, 9);
        prim::fill_(prim::slice(grads[which], 0, 0, 1), bad);
        found = zeros({1}, DType::f32, kGPU);
        amp::unscale_and_check_inf_(grads, found, full({1}, 0.5, DType::f32, kGPU));
        EXPECT_EQ(found.item(), 1.0) << dtype_name(dtype) << " tensor " << which << " value " << bad;
      }
}

// The check alone on the GPU: an inf or NaN in the vectorised body or the
// scalar tail is found, and no element changes.
TEST(CudaAmp, CheckInfFindsEveryNonFiniteAndWritesNothing) {
  MPT_SKIP_WITHOUT_CUDA();
  for (DType dtype : {DType::f32, DType::f16, DType::bf16})
    for (const bool at_end : {false, true}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << (at_end ? " last element" : " first element"));
      std::vector<Tensor> grads = odd_tensors(dtype, kGPU, 9);
      Tensor found = zeros({1}, DType::f32, kGPU);
      amp::check_inf_(grads, found);
      EXPECT_EQ(found.item(), 0.0);
      Tensor& t = grads[13];
      const int64_t at = at_end ? t.numel() - 1 : 0;
      prim::fill_(prim::slice(t, 0, at, at + 1), std::numeric_limits<double>::quiet_NaN());
      const std::vector<Tensor> before = to_cpu(grads);
      amp::check_inf_(grads, found);
      EXPECT_EQ(found.item(), 1.0);
      for (size_t i = 0; i < grads.size(); ++i) {
        const auto a = prim::to(grads[i], DType::f32).to_vector<float>();
        const auto b = prim::to(before[i], DType::f32).to_vector<float>();
        for (size_t j = 0; j < a.size(); ++j)
          ASSERT_TRUE(std::isnan(a[j]) ? std::isnan(b[j]) : a[j] == b[j]) << "tensor " << i << " element " << j;
      }
    }
}

struct OneParam : amp::ScalableOptimizer {
  Tensor param;
  int64_t steps = 0;
  std::vector<Tensor> scalable_parameters() const override { return {param}; }
  void step() override { ++steps; }
};

// Every policy and variant of the rule: hysteresis (counted overall or
// restored by a clean step), PyTorch's with factors f32 cannot hold (the
// products formed in double on the device too), a floor and a cap, a fixed
// scale, and growth counted in samples.
TEST(CudaAmp, ScaleUpdatesOnTheDeviceMatchTheCpu) {
  MPT_SKIP_WITHOUT_CUDA();
  amp::GradScalerOptions hysteresis;
  hysteresis.growth_interval = 3;
  hysteresis.policy = amp::ScalePolicy::hysteresis;
  hysteresis.hysteresis = 2;
  amp::GradScalerOptions consecutive = hysteresis;
  consecutive.consecutive_hysteresis = true;
  amp::GradScalerOptions inexact;
  inexact.growth_interval = 2;
  inexact.growth_factor = 1.2;
  inexact.backoff_factor = 0.8;
  amp::GradScalerOptions capped;
  capped.growth_interval = 2;
  capped.min_scale = 16384.0;
  capped.max_scale = 131072.0;
  amp::GradScalerOptions fixed;
  fixed.policy = amp::ScalePolicy::fixed;
  amp::GradScalerOptions samples;
  samples.growth_interval = 10;
  samples.growth_unit = amp::GrowthUnit::samples;
  int variant = 0;
  for (const amp::GradScalerOptions& o : {hysteresis, consecutive, inexact, capped, fixed, samples}) {
    SCOPED_TRACE(::testing::Message() << "variant " << variant++ << ", " << amp::scale_policy_name(o.policy));
    amp::GradScaler gpu(o), cpu(o);
    OneParam pg, pc;
    pg.param = zeros({5}, DType::f32, kGPU).set_requires_grad(true);
    pc.param = zeros({5}).set_requires_grad(true);
    const double inf = std::numeric_limits<double>::infinity();
    std::set<double> scales_seen;
    for (int i = 0; i < 200; ++i) {
      const bool overflow = (i * 7919) % 11 < 3;
      for (auto [s, p, dev] : {std::tuple{&gpu, &pg, kGPU}, std::tuple{&cpu, &pc, kCPU}}) {
        p->param.set_grad(Tensor());
        backward(s->scale(sum(mul(p->param, full({5}, overflow ? inf : 1.0, DType::f32, dev))), 3 + i % 4));
        s->step(*p);
        s->update();
      }
      ASSERT_EQ(gpu.get_scale(), cpu.get_scale()) << i;
      scales_seen.insert(cpu.get_scale());
      ASSERT_EQ(gpu.growth_tracker(), cpu.growth_tracker()) << i;
      ASSERT_EQ(gpu.hysteresis_left(), cpu.hysteresis_left()) << i;
      ASSERT_EQ(pg.steps, pc.steps) << i;
    }
    // The scale moved (all but the fixed policy); the CPU's trajectory is
    // checked against the written rule in test_grad_scaler.
    if (o.policy != amp::ScalePolicy::fixed) EXPECT_GE(scales_seen.size(), 3u);
    EXPECT_EQ(gpu.scale_tensor().device(), kGPU);
  }
}

TEST(CudaAmp, F16OverflowOnTheGpuIsSkipped) {
  MPT_SKIP_WITHOUT_CUDA();
  Generator gen(5);
  Tensor w = randn({16, 8}, DType::f32, kGPU, &gen).set_requires_grad(true);
  const Tensor x = randn({32, 8}, DType::f32, kGPU, &gen);
  OneParam opt;
  opt.param = w;
  amp::GradScalerOptions o;
  o.init_scale = std::ldexp(1.0, 40);
  amp::GradScaler scaler(o);
  Tensor loss;
  {
    amp::AutocastGuard autocast(DeviceType::cuda, DType::f16);
    loss = mean(linear(x, w));
  }
  backward(scaler.scale(loss));
  const auto before = w.to_vector<float>();
  scaler.step(opt);
  scaler.update();
  EXPECT_EQ(opt.steps, 0);
  EXPECT_EQ(w.to_vector<float>(), before);
  EXPECT_EQ(scaler.get_scale(), std::ldexp(1.0, 39));
}

TEST(CudaAmp, OneScalerServesTwoGpus) {
  MPT_SKIP_WITHOUT_CUDA();
  if (cuda_device_count() < 2) GTEST_SKIP() << "skipped: needs two CUDA devices";
  const Device gpu1{DeviceType::cuda, 1};
  const double inf = std::numeric_limits<double>::infinity();
  for (int bad_device : {0, 1}) {
    struct TwoGpus : amp::ScalableOptimizer {
      std::vector<Tensor> params;
      int64_t steps = 0;
      std::vector<Tensor> scalable_parameters() const override { return params; }
      void step() override { ++steps; }
    } opt;
    opt.params = {zeros({3}, DType::f32, kGPU).set_requires_grad(true),
                  zeros({3}, DType::f32, gpu1).set_requires_grad(true)};
    amp::GradScaler scaler;
    const Tensor x0 = full({3}, bad_device == 0 ? inf : 1.0, DType::f32, kGPU);
    const Tensor x1 = full({3}, bad_device == 1 ? inf : 1.0, DType::f32, gpu1);
    backward(scaler.scale(add(sum(mul(opt.params[0], x0)), to(sum(mul(opt.params[1], x1)), kGPU))));
    scaler.step(opt);
    scaler.update();
    EXPECT_EQ(opt.steps, 0) << bad_device;
    EXPECT_EQ(scaler.get_scale(), 32768.0);
  }
}

std::unique_ptr<nn::Sequential> make_mlp(uint64_t seed) {
  Generator gen(seed);
  auto net = std::make_unique<nn::Sequential>();
  net->push_back(std::make_shared<nn::Linear>(8, 32, true, &gen));
  net->push_back(std::make_shared<nn::ReLU>());
  net->push_back(std::make_shared<nn::Linear>(32, 1, true, &gen));
  net->to(kGPU);
  return net;
}

TEST(CudaAmp, F16AutocastWithScalerMatchesF32TrainingOnTheGpu) {
  MPT_SKIP_WITHOUT_CUDA();
  Generator gen(3);
  const Tensor x = randn({64, 8}, DType::f32, kGPU, &gen);
  const Tensor y = prim::unary(UnaryOp::sin, prim::matmul(x, randn({8, 1}, DType::f32, kGPU, &gen)));
  auto net32 = make_mlp(4), net16 = make_mlp(4);
  optim::SGD opt32(net32->parameters(), {.lr = 0.05});
  optim::SGD opt16(net16->parameters(), {.lr = 0.05});
  amp::GradScalerOptions o;
  o.growth_interval = 50;
  amp::GradScaler scaler(o);
  auto loss_of = [&](nn::Sequential& net) {
    NoGradGuard no_grad;
    return mse_loss(net(x), y).item();
  };
  const double initial = loss_of(*net32);
  for (int step = 0; step < 300; ++step) {
    net32->zero_grad();
    backward(mse_loss(net32->forward(x), y));
    opt32.step();
    net16->zero_grad();
    Tensor loss;
    {
      amp::AutocastGuard autocast(DeviceType::cuda, DType::f16);
      loss = mse_loss(net16->forward(x), y);
    }
    backward(scaler.scale(loss));
    scaler.step(opt16);
    scaler.update();
  }
  const double l32 = loss_of(*net32), l16 = loss_of(*net16);
  EXPECT_LT(l32, 0.3 * initial);
  EXPECT_NEAR(l16, l32, 0.03 * initial) << "f32 " << l32 << " f16 " << l16 << " initial " << initial;
}

}  // namespace
}  // namespace mpt
