// The FP8 scaling rules (amp/fp8_scale_rule.h) against an independent
// statement of them: the delayed recipe's scale recomputed after every
// step from the list of amaxes recorded so far, on random sequences with
// zeros, infinities and NaNs, for both reductions, several history lengths
// and margins.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "amp/fp8_scale_rule.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

using amp::AmaxReduction;
using amp::DelayedScalingRule;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kF32Max = std::numeric_limits<float>::max();

TEST(Fp8ScaleRule, CurrentScalingPutsTheAmaxAtTheFormatsMaximumLessTheMargin) {
  const auto current = [](float amax, float format_max, float margin) {
    return amp::fp8_current_scale(amax, amp::fp8_target_max(format_max, margin));
  };
  EXPECT_EQ(current(2.0f, amp::kE4m3Max, 0.0f), 224.0f);
  EXPECT_EQ(current(448.0f, amp::kE4m3Max, 0.0f), 1.0f);
  EXPECT_EQ(current(7.0f, amp::kE5m2Max, 0.0f), 57344.0f / 7.0f);
  EXPECT_EQ(current(2.0f, amp::kE4m3Max, 1.0f), 112.0f);
  EXPECT_EQ(current(2.0f, amp::kE4m3Max, 3.0f), 28.0f);
  EXPECT_EQ(amp::fp8_target_max(amp::kE4m3Max, 0.5f), static_cast<float>(448.0 / std::sqrt(2.0)));
  // No information: scale 1.
  EXPECT_EQ(current(0.0f, amp::kE4m3Max, 0.0f), 1.0f);
  EXPECT_EQ(current(kInf, amp::kE4m3Max, 0.0f), 1.0f);
  EXPECT_EQ(current(kNaN, amp::kE4m3Max, 0.0f), 1.0f);
  // A subnormal amax would overflow the scale: f32's maximum instead.
  EXPECT_EQ(current(1e-40f, amp::kE4m3Max, 0.0f), kF32Max);
}

// One tensor's delayed-scaling state, fresh: an all-zero history, scale 1.
struct Tracked {
  std::vector<float> history;
  int64_t recorded = 0;
  float scale = 1.0f;
  explicit Tracked(int64_t length) : history(static_cast<size_t>(length), 0.0f) {}
  amp::DelayedScalingState state() { return {history.data(), &recorded, &scale}; }
};

// The delayed recipe as its description states it: the scale after a
// step is (max / 2^margin) over the reduced window of the finite amaxes
// recorded so far (the last `length` of them, zeros where fewer were), or
// the previous scale where that is 0.
struct Reference {
  float format_max;
  float margin;
  int64_t history_length;
  AmaxReduction reduction;
  std::vector<float> recorded;
  float scale = 1.0f;

  void step(float amax) {
    if (!std::isfinite(amax) || amax < 0) return;
    recorded.push_back(amax);
    const size_t n = static_cast<size_t>(history_length);
    const size_t first = recorded.size() > n ? recorded.size() - n : 0;
    float reduced = recorded.back();
    if (reduction == AmaxReduction::max) reduced = *std::max_element(recorded.begin() + first, recorded.end());
    const auto target = static_cast<float>(format_max / std::exp2(static_cast<double>(margin)));
    if (reduced > 0) scale = std::min(target / reduced, kF32Max);
  }
};

TEST(Fp8ScaleRule, DelayedScalingFollowsItsWrittenRuleOnRandomSequences) {
  const uint64_t seed = testing::fresh_seed();
  std::mt19937_64 rng(seed);
  for (AmaxReduction reduction : {AmaxReduction::max, AmaxReduction::most_recent})
    for (int64_t length : {1, 2, 5, 16, 1024})
      for (float margin : {0.0f, 1.0f, 2.5f})
        for (float format_max : {amp::kE4m3Max, amp::kE5m2Max}) {
          SCOPED_TRACE(::testing::Message() << "seed " << seed << " reduction " << static_cast<int>(reduction)
                                            << " length " << length << " margin " << margin << " max "
                                            << format_max);
          const DelayedScalingRule rule{amp::fp8_target_max(format_max, margin), length, reduction};
          Reference ref{format_max, margin, length, reduction};
          Tracked t(length);
          std::uniform_real_distribution<float> log_amax(-12.0f, 12.0f);
          std::uniform_int_distribution<int> kind(0, 19);
          for (int step = 0; step < 3000; ++step) {
            const int k = kind(rng);
            // Mostly a slowly drifting amax, with spikes, zeros, infs and NaNs.
            float amax = std::exp2(std::sin(step * 0.01f) * 6.0f + log_amax(rng) * 0.05f);
            if (k == 0) amax = std::exp2(log_amax(rng));
            if (k == 1) amax = 0.0f;
            if (k == 2) amax = kInf;
            if (k == 3) amax = kNaN;
            const bool taken = amp::update_delayed_scaling(rule, amax, t.state());
            ref.step(amax);
            ASSERT_EQ(taken, std::isfinite(amax)) << "step " << step;
            ASSERT_EQ(t.recorded, static_cast<int64_t>(ref.recorded.size())) << "step " << step;
            ASSERT_EQ(t.scale, ref.scale) << "step " << step << " amax " << amax;
          }
        }
}

TEST(Fp8ScaleRule, AnInfiniteOrNanAmaxNeitherEntersTheHistoryNorMovesTheScale) {
  const DelayedScalingRule rule{amp::kE4m3Max, 4, AmaxReduction::max};
  Tracked t(4);
  const amp::DelayedScalingState s = t.state();
  ASSERT_TRUE(amp::update_delayed_scaling(rule, 2.0f, s));
  EXPECT_EQ(t.scale, 224.0f);
  EXPECT_FALSE(amp::update_delayed_scaling(rule, kInf, s));
  EXPECT_FALSE(amp::update_delayed_scaling(rule, kNaN, s));
  EXPECT_FALSE(amp::update_delayed_scaling(rule, -kInf, s));
  EXPECT_EQ(t.recorded, 1);
  EXPECT_EQ(t.scale, 224.0f);
  EXPECT_EQ(t.history, (std::vector<float>{2.0f, 0.0f, 0.0f, 0.0f}));
}

TEST(Fp8ScaleRule, TheMaximumLeavesTheWindowAfterHistoryLengthSteps) {
  const DelayedScalingRule rule{amp::kE4m3Max, 3, AmaxReduction::max};
  Tracked t(3);
  const amp::DelayedScalingState s = t.state();
  std::vector<float> scales;
  for (float amax : {8.0f, 1.0f, 1.0f, 1.0f, 0.5f, 0.0f, 0.0f, 0.0f}) {
    amp::update_delayed_scaling(rule, amax, s);
    scales.push_back(t.scale);
  }
  // 8 stays the window's maximum for three steps; the all-zero window at
  // the end keeps the last t.scale.
  EXPECT_EQ(scales, (std::vector<float>{56.0f, 56.0f, 56.0f, 448.0f, 448.0f, 448.0f, 896.0f, 896.0f}));
}

TEST(Fp8ScaleRule, MostRecentFollowsEachStepAndKeepsTheScaleOnZero) {
  const DelayedScalingRule rule{amp::fp8_target_max(amp::kE5m2Max, 1.0f), 1024, AmaxReduction::most_recent};
  Tracked t(1024);
  const amp::DelayedScalingState s = t.state();
  amp::update_delayed_scaling(rule, 1024.0f, s);
  EXPECT_EQ(t.scale, 28.0f);
  amp::update_delayed_scaling(rule, 2.0f, s);
  EXPECT_EQ(t.scale, 14336.0f);
  amp::update_delayed_scaling(rule, 0.0f, s);
  EXPECT_EQ(t.scale, 14336.0f);
  EXPECT_EQ(t.recorded, 3);
}

}  // namespace
}  // namespace mpt
