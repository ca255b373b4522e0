// The pieces behind a training run's diagnostics: the step timer's phases
// (CPU clock here; CUDA events on a GPU), the idle-device warning the GPU
// sampler gives, and the rank-imbalance warning.
#include <gtest/gtest.h>

#include <thread>

#include "tensor/step_timer.h"
#include "tests/test_util.h"
#include "diag/training_warnings.h"

namespace mpt {
namespace {

using std::chrono::milliseconds;

TEST(StepTimer, GivesEachPhaseTheTimeSinceThePreviousMark) {
  StepTimer timer(kCPU);
  timer.lap(StepPhase::forward);  // outside a step: ignored
  for (int step = 0; step < 2; ++step) {
    timer.begin_step();
    std::this_thread::sleep_for(milliseconds(20));
    timer.lap(StepPhase::data_wait);
    std::this_thread::sleep_for(milliseconds(10));
    timer.lap(StepPhase::forward);
    std::this_thread::sleep_for(milliseconds(5));
    timer.lap(StepPhase::forward);  // micro-batches add up
    timer.lap(StepPhase::optimizer);
    timer.end_step();
  }
  const StepBreakdown b = timer.take();
  EXPECT_EQ(b.steps, 2);
  EXPECT_GE(b[StepPhase::data_wait], 20.0);
  EXPECT_GE(b[StepPhase::forward], 15.0);
  EXPECT_EQ(b[StepPhase::backward], 0.0);
  EXPECT_EQ(b[StepPhase::comm], 0.0);
  EXPECT_DOUBLE_EQ(b.total_ms(), b[StepPhase::data_wait] + b[StepPhase::forward] + b[StepPhase::optimizer]);
  EXPECT_EQ(timer.take().steps, 0);  // taken: the next window starts empty
}

TEST(StepTimer, CodeInsideAStepMarksThroughTheActiveTimer) {
  StepTimer timer(kCPU);
  EXPECT_EQ(StepTimer::active(), nullptr);
  {
    StepTimer::Activation on(&timer);
    timer.begin_step();
    std::this_thread::sleep_for(milliseconds(5));
    StepTimer::active()->lap(StepPhase::comm);  // as DDP's wait does
    timer.end_step();
  }
  EXPECT_EQ(StepTimer::active(), nullptr);
  EXPECT_GE(timer.take()[StepPhase::comm], 5.0);
}

TEST(StepBreakdown, AddsAsAWeightedMean) {
  StepBreakdown a, b;
  a.steps = 1;
  a.ms[0] = 10;
  b.steps = 3;
  b.ms[0] = 2;
  a.add(b);
  EXPECT_EQ(a.steps, 4);
  EXPECT_DOUBLE_EQ(a.ms[0], 4.0);
}

TEST(IdleDetector, WarnsOnceWhenADeviceIdlesWhileAnotherWorks) {
  diag::IdleDetector idle({"cuda:0", "cuda:1"});
  EXPECT_FALSE(idle.update({95, 0}));
  EXPECT_FALSE(idle.update({95, 3}));
  const auto w = idle.update({97, 0});
  ASSERT_TRUE(w);
  testing::expect_contains(*w, {"cuda:1 has been idle (0%) for 3 samples", "cuda:0 is 97% busy", "data loader"});
  EXPECT_FALSE(idle.update({97, 0}));  // once per episode
  EXPECT_FALSE(idle.update({90, 80}));  // it works again
  EXPECT_FALSE(idle.update({90, 0}));
  EXPECT_FALSE(idle.update({90, 0}));
  EXPECT_TRUE(idle.update({90, 0}));
}

TEST(IdleDetector, StaysQuietWhenAllIdleOrAllWork) {
  diag::IdleDetector idle({"cuda:0", "cuda:1", "cuda:2"});
  for (int i = 0; i < 6; ++i) {
    EXPECT_FALSE(idle.update({0, 2, 1}));  // between epochs, say
    EXPECT_FALSE(idle.update({80, 75, 90}));
  }
}

TEST(ImbalanceWarning, NamesTheSlowRankAgainstTheOthersMedian) {
  EXPECT_FALSE(diag::imbalance_warning({10.0}));
  EXPECT_FALSE(diag::imbalance_warning({10.0, 10.5}));
  EXPECT_FALSE(diag::imbalance_warning({0.2, 0.6}));  // three times, but 0.4 ms: noise
  const auto two = diag::imbalance_warning({10.0, 20.0});
  ASSERT_TRUE(two);
  testing::expect_contains(*two, {"rank 1 works 20.0 ms per step", "10.0 ms (median)"});
  const auto four = diag::imbalance_warning({10.0, 11.0, 9.0, 30.0});
  ASSERT_TRUE(four);
  testing::expect_contains(*four, {"rank 3 works 30.0 ms", "10.0 ms (median)"});
}

}  // namespace
}  // namespace mpt
