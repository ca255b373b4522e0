// The training step's running totals: the loss summed over predictions, the right
// predictions and the step's loss, counted by device ops. Checked against
// the same sums made on the host, on the CPU, on a GPU, and inside a CUDA
// graph replayed on new batches (where only device ops count anything).
#include <gtest/gtest.h>

#include <random>

#include "tensor/graph.h"
#include "tensor/ops.h"
#include "tests/test_util.h"
#include "train/training_totals.h"

namespace mpt {
namespace {

using train::TrainingTotals;

// A micro-batch: a loss value, outputs whose last dimension holds the
// classes, and targets; with the host's count of right predictions.
struct MicroBatch {
  double loss;
  Tensor output, target;
  int64_t right = 0;
};

MicroBatch random_micro_batch(const Shape& rows, int64_t classes, std::mt19937& rng) {
  std::uniform_real_distribution<float> value(-3.0f, 3.0f);
  std::uniform_int_distribution<int64_t> label(0, classes - 1);
  int64_t n = 1;
  for (int64_t r : rows) n *= r;
  std::vector<float> out(static_cast<size_t>(n * classes));
  std::vector<int64_t> target(static_cast<size_t>(n));
  MicroBatch m{std::uniform_real_distribution<double>(0.1, 2.5)(rng), {}, {}};
  for (int64_t i = 0; i < n; ++i) {
    int64_t best = 0;
    for (int64_t k = 0; k < classes; ++k) {
      out[static_cast<size_t>(i * classes + k)] = value(rng);
      if (out[static_cast<size_t>(i * classes + k)] > out[static_cast<size_t>(i * classes + best)]) best = k;
    }
    // About half right, so that a miscount shows.
    target[static_cast<size_t>(i)] = rng() % 2 ? best : label(rng);
    m.right += target[static_cast<size_t>(i)] == best;
  }
  Shape out_shape = rows;
  out_shape.push_back(classes);
  m.output = from_vector(out, out_shape);
  m.target = from_vector(target, rows, DType::i64);
  return m;
}

// The sums the totals must reach, made on the host.
struct Expected {
  double loss_sum = 0, right = 0, step_loss = 0;
  int64_t predictions = 0;
  void add(const MicroBatch& m, double weight) {
    loss_sum += m.loss * static_cast<double>(m.target.numel());
    right += static_cast<double>(m.right);
    step_loss += m.loss * weight;
    predictions += m.target.numel();
  }
};

void expect_totals(const TrainingTotals& totals, const Expected& e) {
  EXPECT_EQ(totals.predictions(), e.predictions);
  EXPECT_NEAR(totals.mean_loss(), e.loss_sum / static_cast<double>(e.predictions), 1e-6);
  EXPECT_DOUBLE_EQ(totals.accuracy(), e.right / static_cast<double>(e.predictions));
  EXPECT_NEAR(totals.step_loss(), e.step_loss, 1e-6);
}

// Two steps of two micro-batches on `device`, outputs in `dtype`.
void check_two_steps(const Device& device, DType dtype, const Shape& rows, int64_t classes) {
  std::mt19937 rng(7);
  TrainingTotals totals(device);
  totals.start_epoch();
  Expected e;
  for (int step = 0; step < 2; ++step) {
    totals.start_step();
    e.step_loss = 0;
    for (int micro = 0; micro < 2; ++micro) {
      const MicroBatch m = random_micro_batch(rows, classes, rng);
      totals.count(m.target.numel());
      const Tensor target = prim::to(m.target, device);
      totals.add(scalar_tensor(m.loss, DType::f32, device), target.numel(), 0.5);
      totals.add_correct(prim::to(prim::to(m.output, dtype), device), target);
      // The loss is rounded to f32 as a real loss is.
      e.add({static_cast<double>(static_cast<float>(m.loss)), m.output, m.target, m.right}, 0.5);
    }
  }
  expect_totals(totals, e);
}

TEST(TrainingTotals, CountLossAndRightPredictionsAsTheHostDoes) {
  check_two_steps(kCPU, DType::f32, {37}, 10);
  check_two_steps(kCPU, DType::f32, {3, 11}, 29);  // sequences: [B, T, V]
}

TEST(TrainingTotals, HostValuesJoinTheDeviceSums) {
  std::mt19937 rng(3);
  TrainingTotals totals(kCPU);
  totals.start_epoch();
  totals.start_step();
  const MicroBatch m = random_micro_batch({20}, 10, rng);
  totals.count(20);
  totals.add(scalar_tensor(0.75, DType::f32), m.target.numel(), 0.5);
  totals.add_correct(m.output, m.target);
  totals.add(1.25, 7, 30, 0.5);  // counts its 30 predictions itself
  EXPECT_EQ(totals.predictions(), 50);
  EXPECT_NEAR(totals.mean_loss(), (0.75 * 20 + 1.25 * 30) / 50, 1e-12);
  EXPECT_DOUBLE_EQ(totals.accuracy(), static_cast<double>(m.right + 7) / 50);
  EXPECT_NEAR(totals.step_loss(), 0.75 * 0.5 + 1.25 * 0.5, 1e-12);
  totals.start_epoch();
  EXPECT_EQ(totals.predictions(), 0);
  EXPECT_EQ(totals.mean_loss(), 0.0);
  EXPECT_EQ(totals.step_loss(), 0.0);
}

TEST(TrainingTotals, RefusesOutputsThatDoNotMatchTheTargets) {
  TrainingTotals totals(kCPU);
  const Tensor logits = zeros({4, 10});
  testing::expect_contains(testing::error_of<ShapeError>([&] { totals.add(zeros({2}), 4, 1.0); }),
                           {"TrainingTotals::add", "f32[2]"});
  testing::expect_contains(
      testing::error_of<ShapeError>([&] { totals.add_correct(logits, zeros({4, 1}, DType::i64)); }),
      {"TrainingTotals::add_correct", "f32[4, 10]", "i64[4, 1]"});
}

TEST(TrainingTotals, CountOnAGpuInHalfPrecision) {
  MPT_SKIP_WITHOUT_CUDA();
  const Device gpu(DeviceType::cuda, 0);
  check_two_steps(gpu, DType::f16, {64}, 10);
  check_two_steps(gpu, DType::f32, {4, 33}, 65);
}

// Run eagerly once, then captured and replayed on new batches: every
// replay counts, with no host code running in it.
TEST(TrainingTotals, CountInsideACapturedStep) {
  MPT_SKIP_WITHOUT_CUDA();
  const Device gpu(DeviceType::cuda, 0);
  TrainingTotals totals(gpu);
  totals.start_epoch();
  CapturedStep step(
      gpu,
      [&](const std::vector<Tensor>& in) {
        totals.start_step();
        totals.add(in[0], in[2].numel(), 1.0);
        totals.add_correct(in[1], in[2]);
      },
      /*eager_steps=*/1);
  std::mt19937 rng(11);
  Expected e;
  for (int replay = 0; replay < 5; ++replay) {
    const MicroBatch m = random_micro_batch({48}, 10, rng);
    const double loss = static_cast<float>(m.loss);
    step.run({scalar_tensor(loss, DType::f32), prim::to(m.output, DType::f16), m.target});
    totals.count(48);
    e.step_loss = 0;
    e.add({loss, m.output, m.target, m.right}, 1.0);
  }
  EXPECT_EQ(step.captures(), 1);
  EXPECT_EQ(step.replays(), 4);
  expect_totals(totals, e);
}

}  // namespace
}  // namespace mpt
