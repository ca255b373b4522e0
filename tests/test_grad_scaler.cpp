// GradScaler: trajectories against an independently written statement of
// each policy's rule, checkpoint round trips, the step/unscale contract, the
// host-sync budget, warnings and the trace.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <random>
#include <vector>

#include "amp/grad_scaler.h"
#include "amp/scale_rule.h"
#include "amp/scaler_trace.h"
#include "autograd/ops.h"
#include "models/clip_grad.h"
#include "models/sgd.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

using amp::GradScaler;
using amp::GradScalerOptions;
using amp::ScalePolicy;

// The rules as the policies' sources state them, kept deliberately
// different in form from amp/scale_rule.h:
//  - torch: torch/amp/grad_scaler.py + _amp_update_scale_cpu_
//  - hysteresis: Megatron-LM DynamicGradScaler.update (with DeepSpeed's
//    consecutive_hysteresis refill on every clean step)
// The scale is f32; its products with the factors are formed in double and
// rounded once, as in PyTorch's _amp_update_scale_ kernels.
struct ReferenceScaler {
  GradScalerOptions o;
  float scale;
  int64_t tracker = 0;
  int32_t hysteresis_left;

  explicit ReferenceScaler(const GradScalerOptions& options)
      : o(options), scale(static_cast<float>(options.init_scale)), hysteresis_left(options.hysteresis) {}

  float floor() const { return static_cast<float>(o.min_scale.value_or(0.0)); }
  float cap() const { return o.max_scale ? static_cast<float>(*o.max_scale) : std::numeric_limits<float>::max(); }

  void grow() {
    const auto g = static_cast<float>(static_cast<double>(scale) * o.growth_factor);
    if (std::isinf(g)) return;  // PyTorch keeps the scale when growing would overflow f32
    if (scale >= cap()) return;
    scale = std::min(g, cap());
  }

  void step(bool found_inf, int64_t units = 1) {
    if (o.policy == ScalePolicy::fixed) return;
    if (o.policy == ScalePolicy::torch) {
      if (found_inf) {
        scale = std::max(static_cast<float>(static_cast<double>(scale) * o.backoff_factor), floor());
        tracker = 0;
      } else {
        tracker += units;
        if (tracker >= o.growth_interval) {
          grow();
          tracker = 0;
        }
      }
      return;
    }
    // hysteresis
    if (found_inf) {
      tracker = 0;
      if (hysteresis_left > 0) hysteresis_left -= 1;
      if (hysteresis_left <= 0)
        scale = std::max(static_cast<float>(static_cast<double>(scale) * o.backoff_factor), floor());
    } else {
      if (o.consecutive_hysteresis) hysteresis_left = o.hysteresis;
      tracker += units;
      if (tracker >= o.growth_interval) {
        tracker = 0;
        hysteresis_left = o.hysteresis;
        grow();
      }
    }
  }
};

std::vector<bool> bernoulli_pattern(size_t n, double p, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::bernoulli_distribution coin(p);
  std::vector<bool> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = coin(rng);
  return out;
}

std::vector<GradScalerOptions> policy_configs() {
  std::vector<GradScalerOptions> configs;
  for (int64_t interval : {1, 3, 7, 50}) {
    GradScalerOptions torch;
    torch.growth_interval = interval;
    configs.push_back(torch);
    GradScalerOptions capped = torch;
    capped.min_scale = 1.0;
    capped.max_scale = 1 << 20;
    capped.growth_factor = 4.0;
    capped.backoff_factor = 0.25;
    configs.push_back(capped);
    // Factors that f32 cannot hold: the products must round as PyTorch's.
    GradScalerOptions inexact = torch;
    inexact.growth_factor = 1.2;
    inexact.backoff_factor = 0.8;
    configs.push_back(inexact);
    for (int32_t h : {1, 2, 5})
      for (bool consecutive : {false, true}) {
        GradScalerOptions hyst = torch;
        hyst.policy = ScalePolicy::hysteresis;
        hyst.hysteresis = h;
        hyst.consecutive_hysteresis = consecutive;
        hyst.min_scale = 0.5;
        configs.push_back(hyst);
      }
    GradScalerOptions fixed = torch;
    fixed.policy = ScalePolicy::fixed;
    configs.push_back(fixed);
  }
  // Growth that would pass the f32 maximum must stop below it.
  GradScalerOptions huge;
  huge.init_scale = 1e38;
  huge.growth_interval = 1;
  configs.push_back(huge);
  return configs;
}

std::string describe(const GradScalerOptions& o) {
  return fmt::format("policy {} interval {} hysteresis {} consecutive {} min {} max {}", amp::scale_policy_name(o.policy),
                     o.growth_interval, o.hysteresis, o.consecutive_hysteresis, o.min_scale.value_or(0),
                     o.max_scale.value_or(0));
}

TEST(ScaleRule, EveryPolicyFollowsTheReferenceOnLongRandomPatterns) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  for (const GradScalerOptions& o : policy_configs()) {
    SCOPED_TRACE(describe(o));
    for (double p : {0.001, 0.02, 0.3}) {
      const auto pattern = bernoulli_pattern(20000, p, seed + static_cast<uint64_t>(p * 1000));
      ReferenceScaler ref(o);
      const amp::ScaleRule rule = amp::scale_rule_from(o);
      amp::ScaleState s{static_cast<float>(o.init_scale), 0, o.hysteresis};
      for (size_t i = 0; i < pattern.size(); ++i) {
        amp::update_scale(rule, pattern[i], 1, s);
        ref.step(pattern[i]);
        ASSERT_EQ(s.scale, ref.scale) << "step " << i << " p " << p;
        ASSERT_EQ(s.growth_tracker, ref.tracker) << "step " << i;
        if (o.policy == ScalePolicy::hysteresis) ASSERT_EQ(s.hysteresis_left, ref.hysteresis_left) << "step " << i;
      }
    }
  }
}

// A one-parameter "model" whose gradient is scale * x, with x = inf on the
// steps the pattern marks: drives a real GradScaler through real backward
// passes and a real optimizer-like step.
class CountingOptimizer : public amp::ScalableOptimizer {
 public:
  explicit CountingOptimizer(Tensor p) : param(std::move(p)) {}
  std::vector<Tensor> scalable_parameters() const override { return {param}; }
  void step() override { ++steps; }
  Tensor param;
  int64_t steps = 0;
};

void backward_step(GradScaler& scaler, CountingOptimizer& opt, bool overflow, int64_t samples = 0) {
  opt.param.set_grad(Tensor());
  const Tensor x = full({4}, overflow ? std::numeric_limits<double>::infinity() : 1.0);
  backward(scaler.scale(sum(mul(opt.param, x)), samples));
}

void run_step(GradScaler& scaler, CountingOptimizer& opt, bool overflow) {
  backward_step(scaler, opt, overflow);
  scaler.step(opt);
  scaler.update();
}

TEST(GradScaler, DefaultsArePyTorchs) {
  GradScaler scaler;
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  EXPECT_EQ(scaler.options().growth_factor, 2.0);
  EXPECT_EQ(scaler.options().backoff_factor, 0.5);
  EXPECT_EQ(scaler.options().growth_interval, 2000);
  EXPECT_EQ(scaler.growth_tracker(), 0);
}

// PyTorch forms scale * factor in double and rounds it to f32 once; with
// factors f32 cannot hold, rounding the factor first drifts within a few
// steps. The expected scales are float32(float64(scale) * factor),
// step by step, from 65536 (f32 factors would give 41943.04296875 and
// 113246.21875).
TEST(GradScaler, FactorsThatF32CannotHoldRoundAsPyTorchs) {
  GradScalerOptions o;
  o.backoff_factor = 0.8;
  o.growth_factor = 1.2;
  o.growth_interval = 1;
  GradScaler backing_off(o);
  CountingOptimizer opt(full({1}, 1.0).set_requires_grad(true));
  for (float want : {52428.80078125f, 41943.0390625f}) {
    run_step(backing_off, opt, /*overflow=*/true);
    EXPECT_EQ(backing_off.get_scale(), want);
  }
  GradScaler growing(o);
  for (float want : {78643.203125f, 94371.84375f, 113246.2109375f, 135895.453125f}) {
    run_step(growing, opt, /*overflow=*/false);
    EXPECT_EQ(growing.get_scale(), want);
  }
}

TEST(GradScaler, TrajectoryAndSkipsFollowTheReferenceAndSurviveACheckpoint) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  std::vector<GradScalerOptions> configs;
  GradScalerOptions torch;
  torch.growth_interval = 5;
  configs.push_back(torch);
  GradScalerOptions hyst = torch;
  hyst.policy = ScalePolicy::hysteresis;
  hyst.hysteresis = 3;
  hyst.min_scale = 1.0;
  configs.push_back(hyst);
  GradScalerOptions fixed = torch;
  fixed.policy = ScalePolicy::fixed;
  configs.push_back(fixed);
  for (const GradScalerOptions& o : configs) {
    SCOPED_TRACE(describe(o));
    auto pattern = bernoulli_pattern(10000, 0.05, seed);
    const size_t checkpoint_at = 4321;
    // An overflow just before the checkpoint: the hysteresis allowance it
    // holds is then below its full value, and must survive the restore.
    pattern[checkpoint_at - 1] = true;
    auto scaler = std::make_unique<GradScaler>(o);
    CountingOptimizer opt(zeros({4}).set_requires_grad(true));
    ReferenceScaler ref(o);
    int64_t expected_steps = 0;
    for (size_t i = 0; i < pattern.size(); ++i) {
      if (i == checkpoint_at) {
        // A fresh scaler restored mid-run must continue identically.
        const auto state = scaler->state_dict();
        scaler = std::make_unique<GradScaler>(o);
        scaler->load_state_dict(state);
        ASSERT_EQ(scaler->steps(), static_cast<int64_t>(i));
        if (o.policy == ScalePolicy::hysteresis) ASSERT_LT(ref.hysteresis_left, o.hysteresis);
      }
      ASSERT_EQ(scaler->get_scale(), ref.scale) << "before step " << i;
      run_step(*scaler, opt, pattern[i]);
      ref.step(pattern[i]);
      if (!pattern[i]) ++expected_steps;
      ASSERT_EQ(opt.steps, expected_steps) << "step " << i;
      ASSERT_EQ(scaler->growth_tracker(), ref.tracker) << "step " << i;
      if (o.policy == ScalePolicy::hysteresis) ASSERT_EQ(scaler->hysteresis_left(), ref.hysteresis_left) << "step " << i;
    }
  }
}

TEST(GradScaler, OneHostSyncPerStepWithAHostSideOptimizer) {
  GradScaler scaler;
  CountingOptimizer opt(zeros({4}).set_requires_grad(true));
  for (int i = 0; i < 20; ++i) run_step(scaler, opt, i % 7 == 3);
  EXPECT_EQ(scaler.host_syncs(), 20);
}

// An optimizer that decides on the device: the scaler must not sync at all.
class DeviceSkippingOptimizer : public CountingOptimizer {
 public:
  using CountingOptimizer::CountingOptimizer;
  bool skips_on_device() const override { return true; }
  void step_skipping_if(const Tensor& found_inf) override { last_found_inf = found_inf; }
  Tensor last_found_inf;
};

TEST(GradScaler, NoHostSyncWhenTheOptimizerReadsFoundInfOnTheDevice) {
  GradScaler scaler;
  DeviceSkippingOptimizer opt(zeros({4}).set_requires_grad(true));
  for (int i = 0; i < 10; ++i) {
    backward_step(scaler, opt, i == 4);
    scaler.step(opt);
    EXPECT_EQ(opt.last_found_inf.item(), i == 4 ? 1.0 : 0.0);
    scaler.update();
  }
  EXPECT_EQ(scaler.host_syncs(), 0);
  EXPECT_EQ(scaler.get_scale(), 32768.0);
}

TEST(GradScaler, UnscaleDividesByTheScale) {
  GradScalerOptions o;
  o.init_scale = 1024;
  GradScaler scaler(o);
  CountingOptimizer opt(zeros({4}).set_requires_grad(true));
  backward_step(scaler, opt, false);
  EXPECT_EQ(opt.param.grad().to_vector<float>(), std::vector<float>(4, 1024.0f));
  scaler.unscale_(opt);
  EXPECT_EQ(opt.param.grad().to_vector<float>(), std::vector<float>(4, 1.0f));
}

// The order the scaler documents for clipping: unscale_, clip_grad_norm_,
// step, update, with a real SGD. clip_grad_norm_ sees the true gradients
// (the norm it returns is theirs, not the scaled one), and step neither
// unscales them again nor skips: each parameter moves by lr * g * min(1,
// max_norm / (|g| + 1e-6)), with g and its norm worked out here from the
// loss sum(p * c) (whose gradient is c). Once with a bound that clips, once
// with one above the norm.
TEST(GradScaler, UnscaleClipStepUsesTheUnscaledClippedGradientsOnce) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  Generator gen(seed);
  for (const double fraction : {0.3, 2.0}) {  // max_norm over the gradients' norm
    SCOPED_TRACE(::testing::Message() << "max_norm / norm " << fraction);
    std::vector<Tensor> params{randn({3, 4}, DType::f32, kCPU, &gen).set_requires_grad(true),
                               randn({5}, DType::f32, kCPU, &gen).set_requires_grad(true)};
    const std::vector<Tensor> coeffs{randn({3, 4}, DType::f32, kCPU, &gen), randn({5}, DType::f32, kCPU, &gen)};
    std::vector<std::vector<double>> start, g;
    double norm_sq = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      start.push_back(testing::host_f64(params[i]));
      g.push_back(testing::host_f64(coeffs[i]));
      for (double v : g.back()) norm_sq += v * v;
    }
    const double norm = std::sqrt(norm_sq), max_norm = fraction * norm, lr = 0.5;
    const double clip = std::min(1.0, max_norm / (norm + 1e-6));

    GradScalerOptions o;
    o.init_scale = 1024;  // a power of two: the unscaled gradients are exactly c
    GradScaler scaler(o);
    optim::SGD opt(params, {.lr = lr});
    backward(scaler.scale(sum(mul(params[0], coeffs[0])) + sum(mul(params[1], coeffs[1]))));
    EXPECT_EQ(testing::host_f64(params[1].grad())[0], 1024 * g[1][0]) << "the gradients were not scaled";
    scaler.unscale_(opt);
    for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(testing::host_f64(params[i].grad()), g[i]) << i;
    const double total = nn::clip_grad_norm_(params, max_norm);
    EXPECT_NEAR(total, norm, 1e-5 * norm) << "the norm clip_grad_norm_ saw";
    scaler.step(opt);
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), 1024.0);  // a clean step, far from the growth interval
    for (size_t i = 0; i < params.size(); ++i) {
      const std::vector<double> now = testing::host_f64(params[i]), grad = testing::host_f64(params[i].grad());
      for (size_t k = 0; k < now.size(); ++k) {
        const double clipped = g[i][k] * clip;
        EXPECT_NEAR(grad[k], clipped, 1e-6 * std::fabs(g[i][k])) << "gradient " << i << " element " << k;
        EXPECT_NEAR(now[k], start[i][k] - lr * clipped, 1e-6 * (std::fabs(start[i][k]) + 1))
            << "parameter " << i << " element " << k;
      }
    }
  }
}

TEST(GradScaler, ContractErrors) {
  GradScaler scaler;
  CountingOptimizer opt(zeros({4}).set_requires_grad(true));
  EXPECT_THROW(scaler.unscale_(opt), ValueError);  // no scale() yet
  backward_step(scaler, opt, false);
  EXPECT_THROW(scaler.update(), ValueError);  // nothing recorded
  scaler.unscale_(opt);
  const auto grad_after_first = opt.param.grad().to_vector<float>();
  try {
    scaler.unscale_(opt);
    FAIL() << "second unscale_ did not throw";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("unscale_"), std::string::npos) << e.what();
  }
  EXPECT_EQ(opt.param.grad().to_vector<float>(), grad_after_first);  // the failed call changed nothing
  scaler.step(opt);
  EXPECT_THROW(scaler.step(opt), ValueError);
  EXPECT_THROW(scaler.unscale_(opt), ValueError);
  scaler.update();
  backward_step(scaler, opt, false);
  EXPECT_NO_THROW(scaler.step(opt));
}

TEST(GradScaler, ABadGradientFailsUnscaleWithNothingUnscaled) {
  GradScaler scaler;
  struct TwoParams : amp::ScalableOptimizer {
    std::vector<Tensor> params{zeros({4}).set_requires_grad(true), zeros({2, 3}).set_requires_grad(true)};
    std::vector<Tensor> scalable_parameters() const override { return params; }
    void step() override {}
  } opt;
  opt.params[1].autograd_meta().name = "head.weight";
  backward(scaler.scale(sum(opt.params[0])));  // grad of params[0]: 65536 each
  opt.params[1].set_grad(prim::transpose(full({3, 2}, 1.0), 0, 1));
  try {
    scaler.unscale_(opt);
    FAIL() << "a strided gradient was accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("head.weight"), std::string::npos) << e.what();
  }
  EXPECT_EQ(opt.params[0].grad().to_vector<float>(), std::vector<float>(4, 65536.0f));
  opt.params[1].set_grad(prim::contiguous(opt.params[1].grad()));
  EXPECT_NO_THROW(scaler.unscale_(opt));  // the failed call left the optimizer ready
  EXPECT_EQ(opt.params[0].grad().to_vector<float>(), std::vector<float>(4, 1.0f));
}

TEST(GradScaler, InvalidOptionsAndStatesAreRejected) {
  GradScalerOptions bad;
  bad.backoff_factor = 1.5;
  EXPECT_THROW(GradScaler{bad}, ValueError);
  bad = {};
  bad.growth_interval = 0;
  EXPECT_THROW(GradScaler{bad}, ValueError);
  bad = {};
  bad.min_scale = 10;
  bad.max_scale = 1;
  EXPECT_THROW(GradScaler{bad}, ValueError);

  GradScaler scaler;
  auto state = scaler.state_dict();
  state["scale"] = -1;
  EXPECT_THROW(scaler.load_state_dict(state), ValueError);
  state = scaler.state_dict();
  state.erase("_growth_tracker");
  EXPECT_THROW(scaler.load_state_dict(state), ValueError);
  state = scaler.state_dict();
  state["_growth_tracker"] = 2000;  // an update would have grown the scale and reset it
  EXPECT_THROW(scaler.load_state_dict(state), ValueError);
  GradScalerOptions bounded;
  bounded.max_scale = 1024;
  bounded.init_scale = 1024;
  GradScaler capped(bounded);
  state = scaler.state_dict();  // scale 65536, above the cap
  EXPECT_THROW(capped.load_state_dict(state), ValueError);
  EXPECT_EQ(scaler.get_scale(), 65536.0);  // nothing changed
}

// A scale outside [min_scale, max_scale] would stay there until the rule
// first moved it, and the scaler's own state would not load back.
TEST(GradScaler, TheInitialScaleMustLieWithinTheBounds) {
  GradScalerOptions o;
  o.max_scale = 1024;  // the default init_scale, 65536, is above it
  const std::string above = testing::error_of<ValueError>([&] { GradScaler{o}; });
  EXPECT_NE(above.find("init_scale 65536 is outside [min_scale, max_scale] = [0, 1024]"), std::string::npos) << above;
  o = {};
  o.init_scale = 1;
  o.min_scale = 4;
  EXPECT_THROW(GradScaler{o}, ValueError);
  o.init_scale = 4;  // at the floor is inside
  GradScaler at_floor(o);
  at_floor.load_state_dict(at_floor.state_dict());
  EXPECT_EQ(at_floor.get_scale(), 4.0);
}

// As torch.amp.GradScaler(enabled=False): a disabled scaler checks no option.
TEST(GradScaler, ADisabledScalerChecksNoOption) {
  GradScalerOptions o;
  o.enabled = false;
  o.growth_factor = 0.5;
  GradScaler scaler(o);
  EXPECT_EQ(scaler.get_scale(), 1.0);
}

// torch.amp.GradScaler.step raises "No inf checks were recorded for this
// optimizer" when none of its parameters has a gradient; counting such a
// step as clean would move the scale towards growth.
TEST(GradScaler, StepRefusesAnOptimizerWithoutGradients) {
  GradScaler scaler;
  CountingOptimizer used(full({1}, 1.0).set_requires_grad(true));
  CountingOptimizer idle(full({1}, 1.0).set_requires_grad(true));
  backward_step(scaler, used, false);  // the loss reaches `used` only
  scaler.step(used);
  const std::string message = testing::error_of<ValueError>([&] { scaler.step(idle); });
  EXPECT_NE(message.find("none of the optimizer's 1 parameters has a gradient"), std::string::npos) << message;
  EXPECT_EQ(idle.steps, 0);
  scaler.update();
  EXPECT_EQ(scaler.growth_tracker(), 1);  // from `used` alone
}

// The state uses PyTorch's keys, so PyTorch loads it; a tracker saved as
// "growth_tracker" (this library's earlier name) still loads.
TEST(GradScaler, StateDictUsesPyTorchsKeys) {
  GradScalerOptions o;
  o.growth_interval = 10;
  GradScaler scaler(o);
  CountingOptimizer opt(full({1}, 1.0).set_requires_grad(true));
  for (int i = 0; i < 3; ++i) run_step(scaler, opt, false);
  auto state = scaler.state_dict();
  for (const char* key : {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"})
    EXPECT_EQ(state.count(key), 1u) << key;
  EXPECT_EQ(state.at("_growth_tracker"), 3.0);
  state["growth_tracker"] = state.at("_growth_tracker");
  state.erase("_growth_tracker");
  GradScaler restored(o);
  restored.load_state_dict(state);
  EXPECT_EQ(restored.growth_tracker(), 3);
}

// torch.amp.GradScaler's state_dict(), as PyTorch writes it, loads.
TEST(GradScaler, LoadsPyTorchsStateDict) {
  GradScaler scaler;
  scaler.load_state_dict({{"scale", 1024.0},
                          {"growth_factor", 2.0},
                          {"backoff_factor", 0.5},
                          {"growth_interval", 100.0},
                          {"_growth_tracker", 37.0}});
  EXPECT_EQ(scaler.get_scale(), 1024.0);
  EXPECT_EQ(scaler.growth_tracker(), 37);
  EXPECT_EQ(scaler.state_dict().at("growth_interval"), 100.0);
}

TEST(GradScaler, DisabledScalerIsTransparent) {
  GradScalerOptions o;
  o.enabled = false;
  GradScaler scaler(o);
  CountingOptimizer opt(zeros({4}).set_requires_grad(true));
  backward_step(scaler, opt, false);
  EXPECT_EQ(opt.param.grad().to_vector<float>(), std::vector<float>(4, 1.0f));
  scaler.step(opt);
  scaler.update();
  EXPECT_EQ(opt.steps, 1);
  EXPECT_EQ(scaler.get_scale(), 1.0);
  EXPECT_TRUE(scaler.state_dict().empty());
}

TEST(GradScaler, GrowthCountedInMicroBatchesOrSamples) {
  // growth_interval 8 micro-batches with 4 micro-batches per step: growth every 2 steps.
  GradScalerOptions o;
  o.growth_interval = 8;
  o.growth_unit = amp::GrowthUnit::micro_batches;
  GradScaler scaler(o);
  CountingOptimizer opt(zeros({4}).set_requires_grad(true));
  ReferenceScaler ref(o);
  for (int step = 0; step < 10; ++step) {
    for (int micro = 0; micro < 4; ++micro) backward_step(scaler, opt, false);
    scaler.step(opt);
    scaler.update();
    ref.step(false, 4);
    EXPECT_EQ(scaler.get_scale(), ref.scale) << step;
  }
  EXPECT_EQ(scaler.get_scale(), 65536.0 * 32);

  o.growth_unit = amp::GrowthUnit::samples;
  o.growth_interval = 100;
  GradScaler by_samples(o);
  ReferenceScaler ref_samples(o);
  for (int step = 0; step < 10; ++step) {
    backward_step(by_samples, opt, false, 30);
    backward_step(by_samples, opt, false, 34);
    by_samples.step(opt);
    by_samples.update();
    ref_samples.step(false, 64);
    EXPECT_EQ(by_samples.get_scale(), ref_samples.scale) << step;
  }
  EXPECT_THROW(backward_step(by_samples, opt, false, 0), ValueError);  // samples must be given
}

TEST(GradScaler, FoundInfGoesThroughTheRankReducer) {
  // A reducer standing in for an all-reduce(max) with a rank that overflowed.
  GradScaler scaler;
  scaler.set_found_inf_reducer([](Tensor& found_inf) { prim::fill_(found_inf, 1.0); });
  CountingOptimizer opt(zeros({4}).set_requires_grad(true));
  run_step(scaler, opt, false);
  EXPECT_EQ(opt.steps, 0);
  EXPECT_EQ(scaler.get_scale(), 32768.0);
}

TEST(GradScaler, FoundInfCombinesAcrossVirtualDevices) {
  // Gradients on cpu:0 and cpu:1 (a single-process replica set): an inf on
  // either device skips the one shared step.
  for (int bad_device : {0, 1}) {
    GradScaler scaler;
    Tensor a = zeros({3}).set_requires_grad(true);
    Tensor b = zeros({3}, DType::f32, Device(DeviceType::cpu, 1)).set_requires_grad(true);
    struct TwoDevices : amp::ScalableOptimizer {
      std::vector<Tensor> params;
      int64_t steps = 0;
      std::vector<Tensor> scalable_parameters() const override { return params; }
      void step() override { ++steps; }
    } opt;
    opt.params = {a, b};
    const double inf = std::numeric_limits<double>::infinity();
    const Tensor xa = full({3}, bad_device == 0 ? inf : 1.0);
    const Tensor xb = full({3}, bad_device == 1 ? inf : 1.0, DType::f32, Device(DeviceType::cpu, 1));
    backward(scaler.scale(add(sum(mul(a, xa)), to(sum(mul(b, xb)), kCPU))));
    scaler.step(opt);
    scaler.update();
    EXPECT_EQ(opt.steps, 0) << bad_device;
    EXPECT_EQ(scaler.get_scale(), 32768.0);
  }
}

TEST(GradScaler, CollapseWarnsWithStepAndParameterName) {
  GradScalerOptions o;
  o.init_scale = 2.0;
  GradScaler scaler(o);
  std::vector<std::string> warnings;
  scaler.set_warning_sink([&](const std::string& w) { warnings.push_back(w); });
  CountingOptimizer opt(zeros({4}).set_requires_grad(true));
  opt.param.autograd_meta().name = "blocks.0.mlp.weight";
  run_step(scaler, opt, true);  // at 2: no warning yet
  EXPECT_TRUE(warnings.empty());
  run_step(scaler, opt, true);  // at 1
  run_step(scaler, opt, true);  // at 0.5: collapsed
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("step 2"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("blocks.0.mlp.weight"), std::string::npos) << warnings[0];
}

TEST(GradScaler, FloorCollapseWarns) {
  GradScalerOptions o;
  o.init_scale = 8.0;
  o.min_scale = 4.0;
  GradScaler scaler(o);
  int warnings = 0;
  scaler.set_warning_sink([&](const std::string&) { ++warnings; });
  CountingOptimizer opt(zeros({4}).set_requires_grad(true));
  for (int i = 0; i < 4; ++i) run_step(scaler, opt, true);
  EXPECT_EQ(scaler.get_scale(), 4.0);
  EXPECT_EQ(warnings, 3);  // every overflow at the floor
}

TEST(ScalerTrace, RowsDescribeEachStepAndRoundTripThroughBothFormats) {
  for (const char* ext : {"jsonl", "csv"}) {
    const std::string path = ::testing::TempDir() + "scaler_trace_test." + ext;
    GradScalerOptions o;
    o.growth_interval = 2;
    o.init_scale = 4;
    {
      GradScaler scaler(o);
      amp::ScalerTraceWriter writer(path);
      scaler.set_trace_sink(writer.sink());
      CountingOptimizer opt(full({4}, 0.0).set_requires_grad(true));
      opt.param.autograd_meta().name = "w";
      for (bool overflow : {false, false, true, false}) run_step(scaler, opt, overflow);
    }
    const auto rows = amp::read_scaler_trace(path);
    ASSERT_EQ(rows.size(), 4u) << ext;
    EXPECT_EQ(rows[0].scale, 4);
    EXPECT_EQ(rows[1].next_scale, 8);
    EXPECT_EQ(rows[2].scale, 8);
    EXPECT_TRUE(rows[2].found_inf && rows[2].skipped);
    EXPECT_EQ(rows[2].first_nonfinite, "w");
    EXPECT_TRUE(std::isinf(rows[2].grad_norm));
    EXPECT_EQ(rows[2].next_scale, 4);
    EXPECT_FALSE(rows[3].found_inf);
    EXPECT_EQ(rows[3].growth_tracker, 1);
    EXPECT_DOUBLE_EQ(rows[3].grad_norm, 2.0);  // unscaled gradient: four ones
    std::remove(path.c_str());
  }
}

// A CSV trace saved with Windows line ends (a spreadsheet's export) reads
// as the same trace; a flag that is neither 1 nor 0 is refused, naming it,
// not read as false.
TEST(ScalerTrace, CsvWithWindowsLineEndsReadsAndBadFlagsAreRefused) {
  const std::string path = ::testing::TempDir() + "scaler_trace_crlf.csv";
  std::ofstream(path, std::ios::binary)
      << "step,scale,next_scale,growth_tracker,hysteresis_left,found_inf,skipped,first_nonfinite,grad_norm\r\n"
      << "0,8,4,0,2,1,1,w,inf\r\n"
      << "1,4,4,1,2,FALSE,0,,0.5\r\n";
  const auto rows = amp::read_scaler_trace(path);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_TRUE(rows[0].found_inf && rows[0].skipped);
  EXPECT_EQ(rows[0].first_nonfinite, "w");
  EXPECT_FALSE(rows[1].found_inf);
  EXPECT_EQ(rows[1].grad_norm, 0.5);
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      << "step,scale,next_scale,growth_tracker,hysteresis_left,found_inf,skipped,first_nonfinite,grad_norm\n"
      << "0,8,4,0,2,yes,1,w,inf\n";
  try {
    amp::read_scaler_trace(path);
    ADD_FAILURE() << "a found_inf of 'yes' was accepted";
  } catch (const IOError& e) {
    EXPECT_NE(std::string(e.what()).find("line 2 is malformed (found_inf must be 1 or 0, got 'yes')"),
              std::string::npos)
        << e.what();
  }
  std::remove(path.c_str());
}

}  // namespace
}  // namespace mpt
