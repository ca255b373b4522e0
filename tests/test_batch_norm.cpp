// Batch normalisation: gradients against finite differences in f64 (batch
// and running statistics), outputs and running statistics against the
// written rule, PyTorch's state-dict names, the layers' modes and options,
// 16-bit inputs against f32.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "models/batch_norm.h"
#include "models/safetensors.h"
#include "tests/gradcheck.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

using testing::expect_gradients_match;
using testing::host_f64;
using testing::leaf;
using V = std::vector<Tensor>;

class BatchNormTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = testing::fresh_seed();
    gen_.manual_seed(seed_);
  }
  std::string trace() const { return "seed " + std::to_string(seed_); }
  uint64_t seed_ = 0;
  Generator gen_;
};

// Per channel c of x [N, C, ...] (host values, row-major): the mean and the
// biased variance over every other dimension.
struct ChannelStats {
  std::vector<double> mean, var;
};
ChannelStats channel_stats(const std::vector<double>& x, const Shape& shape) {
  const int64_t c = shape[1], inner = static_cast<int64_t>(x.size()) / (shape[0] * c);
  ChannelStats s{std::vector<double>(c, 0.0), std::vector<double>(c, 0.0)};
  const double n = static_cast<double>(shape[0] * inner);
  for (int64_t i = 0; i < static_cast<int64_t>(x.size()); ++i) s.mean[(i / inner) % c] += x[i] / n;
  for (int64_t i = 0; i < static_cast<int64_t>(x.size()); ++i) {
    const double d = x[i] - s.mean[(i / inner) % c];
    s.var[(i / inner) % c] += d * d / n;
  }
  return s;
}

TEST_F(BatchNormTest, GradientsMatchFiniteDifferences) {
  SCOPED_TRACE(trace());
  for (const Shape& shape : {Shape{5, 3}, Shape{3, 2, 4}, Shape{2, 3, 2, 3}}) {
    SCOPED_TRACE(shape_str(shape));
    const int64_t c = shape[1];
    const Tensor running_mean = randn({c}, DType::f64, kCPU, &gen_);
    const Tensor running_var = rand({c}, DType::f64, kCPU, &gen_, 0.5, 2.0);
    for (bool training : {true, false}) {
      SCOPED_TRACE(training ? "batch statistics" : "running statistics");
      // The running statistics are updated by each training call; they do
      // not enter a training output, and eval calls read them unchanged.
      const Tensor rm = prim::clone(running_mean), rv = prim::clone(running_var);
      expect_gradients_match(
          [=](const V& v) { return batch_norm(v[0], rm, rv, v[1], v[2], training, 0.1, 1e-5); },
          {leaf(shape, gen_), leaf({c}, gen_, false, 0.5, 1.5), leaf({c}, gen_)});
      expect_gradients_match([=](const V& v) { return batch_norm(v[0], rm, rv, Tensor(), Tensor(), training); },
                             {leaf(shape, gen_)});
    }
  }
}

// y = (x - mean) / sqrt(var + eps) * w + b with the batch's biased variance;
// running = (1 - m) running + m * statistic with the unbiased one; in eval
// mode the running statistics normalise.
TEST_F(BatchNormTest, FollowsTheWrittenRule) {
  SCOPED_TRACE(trace());
  const Shape shape{4, 3, 2, 5};
  const int64_t c = 3;
  const double momentum = 0.25, eps = 1e-3, n = 4 * 2 * 5;
  const Tensor x = randn(shape, DType::f64, kCPU, &gen_);
  const Tensor w = randn({c}, DType::f64, kCPU, &gen_), b = randn({c}, DType::f64, kCPU, &gen_);
  const Tensor rm = randn({c}, DType::f64, kCPU, &gen_), rv = rand({c}, DType::f64, kCPU, &gen_, 0.5, 2.0);
  const std::vector<double> xv = host_f64(x), wv = host_f64(w), bv = host_f64(b), rm0 = host_f64(rm),
                            rv0 = host_f64(rv);
  const ChannelStats s = channel_stats(xv, shape);

  const std::vector<double> y = host_f64(batch_norm(x, rm, rv, w, b, true, momentum, eps));
  const std::vector<double> rm1 = host_f64(rm), rv1 = host_f64(rv);
  for (int64_t i = 0; i < x.numel(); ++i) {
    const int64_t ch = (i / 10) % c;
    EXPECT_NEAR(y[i], (xv[i] - s.mean[ch]) / std::sqrt(s.var[ch] + eps) * wv[ch] + bv[ch], 1e-12) << i;
  }
  for (int64_t ch = 0; ch < c; ++ch) {
    EXPECT_NEAR(rm1[ch], (1 - momentum) * rm0[ch] + momentum * s.mean[ch], 1e-12);
    EXPECT_NEAR(rv1[ch], (1 - momentum) * rv0[ch] + momentum * s.var[ch] * n / (n - 1), 1e-12);
  }

  const std::vector<double> ye = host_f64(batch_norm(x, rm, rv, w, b, false, momentum, eps));
  EXPECT_EQ(host_f64(rm), rm1) << "eval mode changed the running mean";
  EXPECT_EQ(host_f64(rv), rv1) << "eval mode changed the running variance";
  for (int64_t i = 0; i < x.numel(); ++i) {
    const int64_t ch = (i / 10) % c;
    EXPECT_NEAR(ye[i], (xv[i] - rm1[ch]) / std::sqrt(rv1[ch] + eps) * wv[ch] + bv[ch], 1e-12) << i;
  }
}

// The layer: PyTorch's names and initial values, its batch count, momentum
// none as a cumulative average, the modes, and training without tracking.
TEST_F(BatchNormTest, TheLayerKeepsPyTorchsStateAndModes) {
  SCOPED_TRACE(trace());
  nn::BatchNorm2d bn(3);
  const nn::StateDict state = bn.state_dict();
  EXPECT_EQ(state.keys(), (std::vector<std::string>{"weight", "bias", "running_mean", "running_var",
                                                    "num_batches_tracked"}));
  EXPECT_EQ(host_f64(bn.weight), std::vector<double>(3, 1.0));
  EXPECT_EQ(host_f64(bn.bias), std::vector<double>(3, 0.0));
  EXPECT_EQ(host_f64(bn.running_mean), std::vector<double>(3, 0.0));
  EXPECT_EQ(host_f64(bn.running_var), std::vector<double>(3, 1.0));
  EXPECT_EQ(bn.num_batches_tracked.dtype(), DType::i64);
  EXPECT_EQ(bn.num_batches_tracked.shape(), Shape{});

  // momentum none: the running mean is the average of the batch means.
  nn::BatchNorm1d cumulative(2, {.momentum = std::nullopt});
  std::vector<double> sum_of_means(2, 0.0);
  for (int step = 1; step <= 3; ++step) {
    const Tensor x = randn({6, 2}, DType::f32, kCPU, &gen_);
    const ChannelStats s = channel_stats(host_f64(x), x.shape());
    cumulative.forward(x);
    EXPECT_EQ(cumulative.num_batches_tracked.item(), step);
    for (int ch = 0; ch < 2; ++ch) {
      sum_of_means[ch] += s.mean[ch];
      EXPECT_NEAR(host_f64(cumulative.running_mean)[ch], sum_of_means[ch] / step, 1e-6);
    }
  }

  // Eval mode reads the running statistics and leaves them and the count.
  cumulative.eval();
  const Tensor x = randn({6, 2}, DType::f32, kCPU, &gen_);
  const std::vector<double> mean_before = host_f64(cumulative.running_mean);
  const std::vector<double> y = host_f64(cumulative.forward(x));
  EXPECT_EQ(host_f64(cumulative.running_mean), mean_before);
  EXPECT_EQ(cumulative.num_batches_tracked.item(), 3);
  const std::vector<double> xv = host_f64(x), var = host_f64(cumulative.running_var);
  for (size_t i = 0; i < xv.size(); ++i)
    EXPECT_NEAR(y[i], (xv[i] - mean_before[i % 2]) / std::sqrt(var[i % 2] + 1e-5), 1e-5);

  // Without tracking: no buffers, batch statistics in both modes; without
  // affine: no parameters.
  nn::BatchNorm1d plain(2, {.affine = false, .track_running_stats = false});
  EXPECT_TRUE(plain.state_dict().keys().empty());
  plain.eval();
  const ChannelStats s = channel_stats(xv, x.shape());
  const std::vector<double> yp = host_f64(plain.forward(x));
  for (size_t i = 0; i < xv.size(); ++i)
    EXPECT_NEAR(yp[i], (xv[i] - s.mean[i % 2]) / std::sqrt(s.var[i % 2] + 1e-5), 1e-5);
}

// The state (an i64 batch count among f32 tensors) goes through a
// safetensors file and loads into a fresh layer, which then computes what
// the trained one does.
TEST_F(BatchNormTest, TheStateRoundTripsThroughAFile) {
  SCOPED_TRACE(trace());
  testing::TempDir dir{"mpt-batch-norm"};
  nn::BatchNorm2d trained(4);
  for (int i = 0; i < 3; ++i) trained.forward(randn({2, 4, 3, 3}, DType::f32, kCPU, &gen_));
  io::save_safetensors(dir.file("bn.safetensors"), trained.state_dict());
  nn::BatchNorm2d fresh(4);
  fresh.load_state_dict(io::load_safetensors(dir.file("bn.safetensors")).tensors);
  EXPECT_EQ(fresh.num_batches_tracked.item(), 3);
  trained.eval();
  fresh.eval();
  const Tensor x = randn({2, 4, 3, 3}, DType::f32, kCPU, &gen_);
  EXPECT_EQ(fresh.forward(x).to_vector<float>(), trained.forward(x).to_vector<float>());
}

// A 16-bit input gives a 16-bit output and gradient, computed in f32: the
// f32 results rounded once.
TEST_F(BatchNormTest, SixteenBitInputsComputeInF32) {
  SCOPED_TRACE(trace());
  for (DType dt : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor x16 = prim::to(randn({8, 3, 4, 4}, DType::f32, kCPU, &gen_), dt);
    const Tensor x32 = prim::to(x16, DType::f32);
    const Tensor w = randn({3}, DType::f32, kCPU, &gen_), b = randn({3}, DType::f32, kCPU, &gen_);
    const Tensor a = prim::clone(x16).set_requires_grad(true), a32 = prim::clone(x32).set_requires_grad(true);
    const Tensor y16 = batch_norm(a, Tensor(), Tensor(), w, b, true);
    const Tensor y32 = batch_norm(a32, Tensor(), Tensor(), w, b, true);
    ASSERT_EQ(y16.dtype(), dt);
    EXPECT_EQ(host_f64(y16), host_f64(prim::to(y32, dt)));
    const Tensor g = randn(y32.shape(), DType::f32, kCPU, &gen_);
    backward(sum(mul(y16, prim::to(g, dt))));
    backward(sum(mul(y32, prim::to(prim::to(g, dt), DType::f32))));
    ASSERT_EQ(a.grad().dtype(), dt);
    EXPECT_EQ(host_f64(a.grad()), host_f64(prim::to(a32.grad(), dt)));
  }
}

}  // namespace
}  // namespace mpt
