// The scaler lab: overflow patterns, replay (which must match what a real
// GradScaler does on the same pattern) and growth-interval sweeps.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <random>

#include "amp/scaler_replay.h"
#include "amp/scaler_sweep.h"
#include "autograd/ops.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

TEST(OverflowPatterns, GeneratedPatternsFollowTheirDefinitions) {
  const auto periodic = amp::periodic_overflows(100, 10);
  for (int64_t i = 0; i < 100; ++i) EXPECT_EQ(periodic[i], (i + 1) % 10 == 0) << i;
  const auto bursts = amp::burst_overflows(100, 20, 3);
  for (int64_t i = 0; i < 100; ++i) {
    const bool in_burst = i >= 19 && (i - 19) % 20 < 3;
    EXPECT_EQ(bursts[i], in_burst) << i;
  }
  const auto b = amp::bernoulli_overflows(200000, 0.01, 5);
  int64_t n = 0;
  for (bool v : b) n += v;
  EXPECT_NEAR(n, 2000, 5 * std::sqrt(2000.0));  // 5 sigma
  EXPECT_EQ(b, amp::bernoulli_overflows(200000, 0.01, 5));  // seeded
  // The written rule, which no standard library's choices enter: step i
  // overflows when mt19937_64's i-th number, as a 53-bit fraction, is below p.
  std::mt19937_64 rng(5);
  for (size_t i = 0; i < b.size(); ++i)
    ASSERT_EQ(b[i], static_cast<double>(rng() >> 11) / 9007199254740992.0 < 0.01) << i;
  EXPECT_THROW(amp::overflow_pattern_from_spec("gaussian:3", 10, 0), ValueError);
  EXPECT_THROW(amp::overflow_pattern_from_spec("bursts:5", 10, 0), ValueError);
  EXPECT_EQ(amp::overflow_pattern_from_spec("periodic:10", 100, 0), periodic);
}

TEST(OverflowPatterns, ReadFromAFile) {
  const std::string path = ::testing::TempDir() + "overflow_pattern.txt";
  {
    std::ofstream out(path);
    out << "# a comment\n0\n1\n\n0  # trailing comment\ntrue\n";
  }
  EXPECT_EQ(amp::read_overflow_pattern(path), (std::vector<bool>{false, true, false, true}));
  {
    std::ofstream out(path);
    out << "0\nmaybe\n";
  }
  EXPECT_THROW(amp::read_overflow_pattern(path), IOError);
  std::remove(path.c_str());
}

struct OneParam : amp::ScalableOptimizer {
  Tensor param = zeros({2}).set_requires_grad(true);
  std::vector<Tensor> scalable_parameters() const override { return {param}; }
  void step() override {}
};

TEST(ScalerReplay, MatchesARealScalerOnTheSamePattern) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  const auto pattern = amp::bernoulli_overflows(3000, 0.02, seed);
  for (amp::ScalePolicy policy : {amp::ScalePolicy::torch, amp::ScalePolicy::hysteresis, amp::ScalePolicy::fixed}) {
    amp::GradScalerOptions o;
    o.policy = policy;
    o.growth_interval = 25;
    o.min_scale = 1;
    const auto replayed = amp::replay_overflows(o, pattern);
    std::vector<amp::ScalerTraceRow> real;
    amp::GradScaler scaler(o);
    scaler.set_trace_sink([&](const amp::ScalerTraceRow& r) { real.push_back(r); });
    OneParam opt;
    for (bool overflow : pattern) {
      opt.param.set_grad(Tensor());
      backward(scaler.scale(sum(mul(opt.param, full({2}, overflow ? std::numeric_limits<double>::infinity() : 1.0)))));
      scaler.step(opt);
      scaler.update();
    }
    ASSERT_EQ(real.size(), replayed.size());
    for (size_t i = 0; i < real.size(); ++i) {
      ASSERT_EQ(real[i].scale, replayed[i].scale) << amp::scale_policy_name(policy) << " step " << i;
      ASSERT_EQ(real[i].next_scale, replayed[i].next_scale) << i;
      ASSERT_EQ(real[i].growth_tracker, replayed[i].growth_tracker) << i;
      ASSERT_EQ(real[i].found_inf, replayed[i].found_inf) << i;
    }
  }
}

// A trace row names its policy and leaves out what does not apply to it:
// hysteresis_left outside the hysteresis policy, a gradient norm that was
// not measured (-1), a gradient name where there is none. Read back, the
// rows are the same (the fields left out at their defaults), from JSON
// lines and CSV alike.
TEST(ScalerReplay, TraceRowsNameThePolicyAndLeaveOutWhatDoesNotApply) {
  amp::GradScalerOptions o;
  o.growth_interval = 3;
  const auto pattern = amp::periodic_overflows(8, 4);
  const auto torch = amp::replay_overflows(o, pattern);
  o.policy = amp::ScalePolicy::hysteresis;
  const auto hysteresis = amp::replay_overflows(o, pattern);
  // Three clean steps grow the scale; step 3 overflows at 2^17.
  EXPECT_EQ(amp::scaler_trace_row_json(torch[3]),
            R"({"step":3,"policy":"torch","scale":131072.0,"next_scale":65536.0,"growth_tracker":0,)"
            R"("found_inf":true,"skipped":true})");
  EXPECT_EQ(amp::scaler_trace_row_json(hysteresis[3]),
            R"({"step":3,"policy":"hysteresis","scale":131072.0,"next_scale":131072.0,"growth_tracker":0,)"
            R"("hysteresis_left":1,"found_inf":true,"skipped":true})");
  amp::ScalerTraceRow measured;  // as a real scaler records an overflow
  measured.step = 5;
  measured.policy = amp::ScalePolicy::fixed;
  measured.scale = measured.next_scale = 8;
  measured.found_inf = measured.skipped = true;
  measured.first_nonfinite = "fc.weight";
  measured.grad_norm = std::numeric_limits<double>::infinity();
  EXPECT_EQ(amp::scaler_trace_row_json(measured),
            R"({"step":5,"policy":"static","scale":8.0,"next_scale":8.0,"growth_tracker":0,"found_inf":true,)"
            R"("skipped":true,"first_nonfinite":"fc.weight","grad_norm":"inf"})");

  std::vector<amp::ScalerTraceRow> rows = torch;
  rows.insert(rows.end(), hysteresis.begin(), hysteresis.end());
  rows.push_back(measured);
  for (const char* ext : {"jsonl", "csv"}) {
    SCOPED_TRACE(ext);
    const std::string path = ::testing::TempDir() + "scaler_lab_rows." + ext;
    {
      amp::ScalerTraceWriter writer(path);
      for (const auto& r : rows) writer.write(r);
    }
    const auto back = amp::read_scaler_trace(path);
    ASSERT_EQ(back.size(), rows.size());
    for (size_t i = 0; i < rows.size(); ++i) {
      SCOPED_TRACE(i);
      EXPECT_EQ(back[i].step, rows[i].step);
      EXPECT_EQ(back[i].policy, rows[i].policy);
      EXPECT_EQ(back[i].scale, rows[i].scale);
      EXPECT_EQ(back[i].next_scale, rows[i].next_scale);
      EXPECT_EQ(back[i].growth_tracker, rows[i].growth_tracker);
      EXPECT_EQ(back[i].hysteresis_left,
                rows[i].policy == amp::ScalePolicy::hysteresis ? rows[i].hysteresis_left : 0);
      EXPECT_EQ(back[i].found_inf, rows[i].found_inf);
      EXPECT_EQ(back[i].skipped, rows[i].skipped);
      EXPECT_EQ(back[i].first_nonfinite, rows[i].first_nonfinite);
      EXPECT_EQ(back[i].grad_norm, rows[i].grad_norm);
    }
    std::remove(path.c_str());
  }
}

TEST(ScalerSweep, CollectsSkipsTimeAtScaleAndLossPerInterval) {
  // A "training" whose gradients overflow every 10th step.
  auto train = [](const amp::GradScalerOptions& options, const amp::ScalerTraceSink& trace) {
    amp::GradScaler scaler(options);
    scaler.set_trace_sink(trace);
    OneParam opt;
    for (int step = 0; step < 100; ++step) {
      opt.param.set_grad(Tensor());
      const bool overflow = step % 10 == 9;
      backward(scaler.scale(sum(mul(opt.param, full({2}, overflow ? std::numeric_limits<double>::infinity() : 1.0)))));
      scaler.step(opt);
      scaler.update();
    }
    return scaler.get_scale();  // stands in for the final loss
  };
  std::vector<size_t> progress;
  const auto runs = amp::sweep_growth_interval({}, {3, 100}, train, [&](size_t done, size_t) { progress.push_back(done); });
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(progress, (std::vector<size_t>{1, 2}));
  for (const auto& run : runs) {
    EXPECT_EQ(run.steps, 100);
    EXPECT_EQ(run.skipped_steps, 10);
    int64_t total = 0;
    for (const auto& [scale, n] : run.steps_at_scale) total += n;
    EXPECT_EQ(total, 100);
  }
  // Interval 100 never grows: 65536 halves at each of the 10 overflows.
  EXPECT_EQ(runs[1].final_loss, 65536.0 / 1024);
  EXPECT_EQ(runs[1].steps_at_scale.at(65536.0), 10);
  // Interval 3 grows three times between overflows (9 clean steps) and halves once: x4 per 10 steps.
  EXPECT_EQ(runs[0].final_loss, 65536.0 * std::pow(4.0, 10));
}

}  // namespace
}  // namespace mpt
