// Every op's backward rule against central differences in f64, on random
// shapes with broadcasting and non-contiguous inputs; and the engine itself.
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "autograd/ops.h"
#include "tests/gradcheck.h"

namespace mpt {
namespace {

using testing::expect_gradients_match;
using testing::leaf;
using V = std::vector<Tensor>;

class Gradcheck : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = testing::fresh_seed();
    gen_.manual_seed(seed_);
  }
  Tensor x(const Shape& s, bool transposed = false, double lo = -1, double hi = 1) {
    return leaf(s, gen_, transposed, lo, hi);
  }
  // Values kept away from 0 (for kinks such as relu's).
  Tensor away_from_zero(const Shape& s) {
    Tensor t = prim::mul(prim::add_scalar(rand(s, DType::f64, kCPU, &gen_), 0.2),
                         prim::add_scalar(prim::mul_scalar(prim::binary(BinaryOp::gt, rand(s, DType::f64, kCPU, &gen_),
                                                                        full({}, 0.5, DType::f64)),
                                                           2.0),
                                          -1.0));
    t.set_requires_grad(true);
    return t;
  }
  uint64_t seed_ = 0;
  Generator gen_;
};

#define TRACE_SEED() SCOPED_TRACE(::testing::Message() << "seed " << seed_)

TEST_F(Gradcheck, BroadcastingArithmetic) {
  TRACE_SEED();
  expect_gradients_match([](const V& v) { return v[0] + v[1]; }, {x({3, 1, 4}), x({2, 4}, true)});
  expect_gradients_match([](const V& v) { return v[0] - v[1]; }, {x({4}), x({3, 4})});
  expect_gradients_match([](const V& v) { return v[0] * v[1]; }, {x({2, 3, 4}, true), x({3, 1})});
  expect_gradients_match([](const V& v) { return v[0] / v[1]; }, {x({3, 4}), x({4}, false, 0.5, 2)});
  expect_gradients_match([](const V& v) { return v[0] * 2.5 + 1.0; }, {x({5})});
  expect_gradients_match([](const V& v) { return -v[0]; }, {x({2, 3}, true)});
}

TEST_F(Gradcheck, UnaryFunctions) {
  TRACE_SEED();
  expect_gradients_match([](const V& v) { return exp(v[0]); }, {x({3, 4}, true)});
  expect_gradients_match([](const V& v) { return log(v[0]); }, {x({3, 4}, false, 0.2, 3)});
  expect_gradients_match([](const V& v) { return sqrt(v[0]); }, {x({3, 4}, true, 0.2, 3)});
  expect_gradients_match([](const V& v) { return tanh(v[0]); }, {x({3, 4})});
  expect_gradients_match([](const V& v) { return sigmoid(v[0]); }, {x({3, 4})});
  expect_gradients_match([](const V& v) { return relu(v[0]); }, {away_from_zero({4, 5})});
  expect_gradients_match([](const V& v) { return gelu(v[0]); }, {x({4, 5}, false, -3, 3)});
  expect_gradients_match([](const V& v) { return gelu(v[0], GeluApprox::tanh); }, {x({4, 5}, false, -3, 3)});
  expect_gradients_match([](const V& v) { return pow(v[0], 2.7); }, {x({3, 4}, false, 0.2, 2)});
  expect_gradients_match([](const V& v) { return pow(v[0], v[1]); }, {x({3, 4}, false, 0.2, 2), x({4}, false, -1, 2)});
}

TEST_F(Gradcheck, Reductions) {
  TRACE_SEED();
  for (bool keep : {false, true}) {
    expect_gradients_match([=](const V& v) { return sum(v[0], {1}, keep); }, {x({3, 4, 5}, true)});
    expect_gradients_match([=](const V& v) { return mean(v[0], {0, 2}, keep); }, {x({3, 4, 5})});
  }
  expect_gradients_match([](const V& v) { return sum(v[0]); }, {x({3, 4})});
  expect_gradients_match([](const V& v) { return mean(v[0]); }, {x({3, 4}, true)});
}

TEST_F(Gradcheck, MatrixProducts) {
  TRACE_SEED();
  expect_gradients_match([](const V& v) { return matmul(v[0], v[1]); }, {x({4, 5}), x({5, 3}, true)});
  expect_gradients_match([](const V& v) { return matmul(v[0], v[1]); }, {x({2, 4, 5}, true), x({5, 3})});
  expect_gradients_match([](const V& v) { return matmul(v[0], v[1]); }, {x({2, 3, 4, 5}), x({3, 5, 2}, true)});
  expect_gradients_match([](const V& v) { return bmm(v[0], v[1]); }, {x({2, 4, 5}), x({2, 5, 3})});
  expect_gradients_match([](const V& v) { return linear(v[0], v[1], v[2]); }, {x({2, 3, 5}), x({4, 5}), x({4})});
  expect_gradients_match([](const V& v) { return linear(v[0], v[1]); }, {x({3, 5}, true), x({4, 5})});
  expect_gradients_match([](const V& v) { return linear_relu(v[0], v[1], v[2]); }, {x({2, 3, 5}), x({4, 5}), x({4})});
  expect_gradients_match([](const V& v) { return linear_relu(v[0], v[1]); }, {x({3, 5}, true), x({4, 5})});
}

TEST_F(Gradcheck, ShapeOps) {
  TRACE_SEED();
  expect_gradients_match([](const V& v) { return reshape(v[0], {6, -1}); }, {x({3, 2, 4}, true)});
  expect_gradients_match([](const V& v) { return view(v[0], {2, 12}); }, {x({3, 2, 4})});
  expect_gradients_match([](const V& v) { return flatten(v[0]); }, {x({2, 3, 4})});
  expect_gradients_match([](const V& v) { return transpose(v[0], 0, 2) * 1.5; }, {x({2, 3, 4})});
  expect_gradients_match([](const V& v) { return permute(v[0], {2, 0, 1}); }, {x({2, 3, 4}, true)});
  expect_gradients_match([](const V& v) { return slice(v[0], 1, 1, 6, 2); }, {x({3, 7})});
  expect_gradients_match([](const V& v) { return unsqueeze(squeeze(v[0], 1), 0); }, {x({3, 1, 4})});
  expect_gradients_match([](const V& v) { return expand(v[0], {2, 3, 4}); }, {x({3, 1})});
  expect_gradients_match([](const V& v) { return contiguous(v[0]); }, {x({3, 4}, true)});
  expect_gradients_match([](const V& v) { return cat({v[0], v[1], v[0]}, 1); }, {x({2, 3}), x({2, 1}, true)});
  expect_gradients_match(
      [](const V& v) {
        auto parts = split(v[0], 2, 0);
        return parts[0] * parts[1] + parts[2];  // the last chunk is [1, 3] and broadcasts
      },
      {x({5, 3})});
}

TEST_F(Gradcheck, SoftmaxFamilyAndLosses) {
  TRACE_SEED();
  expect_gradients_match([](const V& v) { return softmax(v[0], 1); }, {x({3, 5}, true, -3, 3)});
  expect_gradients_match([](const V& v) { return softmax(v[0], 0); }, {x({4, 3}, false, -3, 3)});
  expect_gradients_match([](const V& v) { return log_softmax(v[0], -1); }, {x({2, 3, 5}, false, -3, 3)});
  const Tensor target = from_vector(std::vector<int64_t>{2, 0, 4, 1, 4, 3}, {6}, DType::i64);
  // The losses compute in f32 inside, so the tolerance is f32's.
  for (Reduction r : {Reduction::mean, Reduction::sum, Reduction::none})
    expect_gradients_match([&](const V& v) { return to(cross_entropy(v[0], target, -100, r), DType::f64); },
                           {x({6, 5}, true, -2, 2)}, 2e-3, 1e-3);
  const Tensor with_ignored = from_vector(std::vector<int64_t>{2, -1, 4, -1, 0, 3}, {6}, DType::i64);
  expect_gradients_match([&](const V& v) { return to(cross_entropy(v[0], with_ignored, -1), DType::f64); },
                         {x({6, 5}, false, -2, 2)}, 2e-3, 1e-3);
  expect_gradients_match([](const V& v) { return to(mse_loss(v[0], v[1]), DType::f64); }, {x({3, 4}), x({3, 4})},
                         2e-3, 1e-3);
}

TEST_F(Gradcheck, LayerNormEmbeddingDropout) {
  TRACE_SEED();
  expect_gradients_match([](const V& v) { return to(layer_norm(v[0], v[1], v[2]), DType::f64); },
                         {x({2, 3, 6}, false, -2, 2), x({6}, false, 0.5, 1.5), x({6})}, 2e-3, 1e-3);
  const Tensor idx = from_vector(std::vector<int64_t>{1, 3, 1, 0, 3, 3}, {2, 3}, DType::i64);
  expect_gradients_match([&](const V& v) { return embedding(v[0], idx); }, {x({5, 4})});
  // Dropout draws the same mask when the generator is reset each time.
  const uint64_t seed = seed_;
  expect_gradients_match(
      [=](const V& v) {
        Generator g(seed);
        return dropout(v[0], 0.3, true, &g);
      },
      {x({4, 6})});
}

TEST_F(Gradcheck, ConvolutionAndPooling) {
  TRACE_SEED();
  for (const Conv2dParams& p : {Conv2dParams{}, Conv2dParams{2, 1, 1, 1, 1, 1}, Conv2dParams{1, 2, 0, 1, 2, 1}}) {
    expect_gradients_match([&](const V& v) { return conv2d(v[0], v[1], v[2], p); },
                           {x({2, 3, 7, 6}), x({4, 3, 3, 2}), x({4})});
  }
  for (const Pool2dParams& p : {Pool2dParams{}, Pool2dParams{3, 3, 2, 2, 1, 1}})
    expect_gradients_match([&](const V& v) { return max_pool2d(v[0], p); }, {x({2, 3, 7, 6})});
}

TEST_F(Gradcheck, Attention) {
  TRACE_SEED();
  for (bool causal : {true, false})
    expect_gradients_match([=](const V& v) { return scaled_dot_product_attention(v[0], v[1], v[2], causal); },
                           {x({2, 2, 5, 3}), x({2, 2, 5, 3}), x({2, 2, 5, 3})});
}

// ---- forward values of the composite ops ---------------------------------------------

TEST(AutogradForward, AttentionMatchesExplicitMath) {
  Generator gen(testing::fresh_seed());
  const Tensor q = randn({1, 1, 4, 2}, DType::f64, kCPU, &gen), k = randn({1, 1, 4, 2}, DType::f64, kCPU, &gen),
               v = randn({1, 1, 4, 2}, DType::f64, kCPU, &gen);
  const auto y = scaled_dot_product_attention(q, k, v, true).to_vector<double>();
  const auto qv = q.to_vector<double>(), kv = k.to_vector<double>(), vv = v.to_vector<double>();
  for (int i = 0; i < 4; ++i) {
    std::vector<double> w(4, 0.0);
    double total = 0;
    for (int j = 0; j <= i; ++j) {
      w[j] = std::exp((qv[i * 2] * kv[j * 2] + qv[i * 2 + 1] * kv[j * 2 + 1]) / std::sqrt(2.0));
      total += w[j];
    }
    for (int d = 0; d < 2; ++d) {
      double ref = 0;
      for (int j = 0; j <= i; ++j) ref += w[j] / total * vv[j * 2 + d];
      EXPECT_NEAR(y[i * 2 + d], ref, 1e-12);
    }
  }
}

// The CPU, and the first GPU where there is one: the composed ops and the
// fused kernels.
std::vector<Device> cpu_and_gpu() {
  std::vector<Device> devices{kCPU};
  if (testing::has_cuda()) devices.emplace_back("cuda:0");
  return devices;
}

// A norm written straight in 16 bits (what a matmul under autocast would
// cast it to) is the f32 norm and then the cast, bit for bit, forward and
// in every gradient: the kernel rounds the same f32 values on its store and
// widens the 16-bit gradient as the cast's backward would. On the CPU (the
// composed norm) and on the GPU (the fused kernel); a 16-bit input asked
// for f32 takes the composed path and matches the widened input's norm.
TEST(AutogradForward, LayerNormWrittenInSixteenBitsIsTheNormThenTheCast) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  for (const Device& device : cpu_and_gpu())
    for (DType low : {DType::f16, DType::bf16}) {
      SCOPED_TRACE(::testing::Message() << device.str() << " " << dtype_name(low));
      Generator gen(seed);
      const Tensor x0 = prim::to(randn({3, 5, 384}, DType::f32, kCPU, &gen), device);
      const Tensor w0 = prim::to(randn({384}, DType::f32, kCPU, &gen), device);
      const Tensor b0 = prim::to(randn({384}, DType::f32, kCPU, &gen), device);
      const Tensor dy = prim::to(randn({3, 5, 384}, low, kCPU, &gen), device);
      std::vector<std::vector<std::vector<float>>> runs;
      for (bool direct : {true, false}) {
        Tensor x = prim::clone(x0), w = prim::clone(w0), b = prim::clone(b0);
        for (Tensor* t : {&x, &w, &b}) t->set_requires_grad(true);
        const Tensor y = direct ? layer_norm(x, w, b, 1e-5, low) : to(layer_norm(x, w, b), low);
        ASSERT_EQ(y.dtype(), low);
        backward(y, dy);
        runs.push_back({prim::to(y, DType::f32).to_vector<float>(), x.grad().to_vector<float>(),
                        w.grad().to_vector<float>(), b.grad().to_vector<float>()});
      }
      EXPECT_EQ(runs[0][0], runs[1][0]) << "forward";
      EXPECT_EQ(runs[0][1], runs[1][1]) << "gradient of x";
      EXPECT_EQ(runs[0][2], runs[1][2]) << "gradient of the weight";
      EXPECT_EQ(runs[0][3], runs[1][3]) << "gradient of the bias";

      const Tensor x16 = prim::to(x0, low), w16 = prim::to(w0, low), b16 = prim::to(b0, low);
      const Tensor asked = layer_norm(x16, w16, b16, 1e-5, DType::f32);
      ASSERT_EQ(asked.dtype(), DType::f32);
      const Tensor widened = layer_norm(prim::to(x16, DType::f32), prim::to(w16, DType::f32), prim::to(b16, DType::f32));
      EXPECT_LE(testing::rel_error(testing::host_f64(asked), testing::host_f64(widened)), 1e-5);
    }
}

// The norm with its input passed on beside it is x and the norm, with x's
// gradient the sum of both paths' (the fused kernel adds the skip path's as
// it writes dx): bit for bit the composed expression, forward and backward,
// on the CPU (composed) and the GPU (one node), in f32 and into 16 bits.
TEST(AutogradForward, LayerNormWithSkipIsTheInputAndTheNorm) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  for (const Device& device : cpu_and_gpu())
    for (DType out : {DType::f32, DType::f16}) {
      SCOPED_TRACE(::testing::Message() << device.str() << " into " << dtype_name(out));
      Generator gen(seed);
      auto draw = [&](const Shape& s) { return prim::to(randn(s, DType::f32, kCPU, &gen), device); };
      const Tensor x0 = draw({4, 7, 96}), w0 = draw({96}), b0 = draw({96}), dskip = draw({4, 7, 96}),
                   dnorm = draw({4, 7, 96});
      std::vector<std::vector<std::vector<float>>> runs;
      for (bool fused : {true, false}) {
        Tensor x = prim::clone(x0), w = prim::clone(w0), b = prim::clone(b0);
        for (Tensor* t : {&x, &w, &b}) t->set_requires_grad(true);
        Tensor skip, normed;
        if (fused) {
          std::tie(skip, normed) = layer_norm_with_skip(x, w, b, 1e-5, out);
        } else {
          skip = x;
          normed = to(layer_norm(x, w, b), out);
        }
        ASSERT_EQ(skip.dtype(), DType::f32);
        ASSERT_EQ(normed.dtype(), out);
        backward(sum(skip * dskip) + sum(to(normed, DType::f32) * dnorm));
        runs.push_back({skip.to_vector<float>(), prim::to(normed, DType::f32).to_vector<float>(),
                        x.grad().to_vector<float>(), w.grad().to_vector<float>(), b.grad().to_vector<float>()});
      }
      const char* what[] = {"skip", "norm", "gradient of x", "gradient of the weight", "gradient of the bias"};
      for (size_t i = 0; i < runs[0].size(); ++i) EXPECT_EQ(runs[0][i], runs[1][i]) << what[i];
    }
}

TEST(AutogradForward, CrossEntropyMatchesDefinition) {
  const Tensor logits = from_vector({1.f, 2.f, 3.f, 0.f, 0.f, 0.f}, {2, 3});
  const Tensor target = from_vector(std::vector<int64_t>{2, 1}, {2}, DType::i64);
  const double l0 = -std::log(std::exp(3.0) / (std::exp(1.0) + std::exp(2.0) + std::exp(3.0)));
  const double l1 = std::log(3.0);
  EXPECT_NEAR(cross_entropy(logits, target).item(), (l0 + l1) / 2, 1e-6);
  EXPECT_NEAR(cross_entropy(logits, target, 1).item(), l0, 1e-6);  // second sample ignored
  EXPECT_NEAR(cross_entropy(logits, target, -100, Reduction::sum).item(), l0 + l1, 1e-6);
  EXPECT_EQ(cross_entropy(to(logits, DType::f16), target).dtype(), DType::f32);
}

TEST(AutogradForward, BadInputNamesTheOpAndShapes) {
  const Tensor logits = zeros({2, 3});
  auto message = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_NE(message([&] { cross_entropy(logits, from_vector(std::vector<int64_t>{0, 3}, {2}, DType::i64)); })
                .find("cross_entropy: index 3 is out of range [0, 3)"),
            std::string::npos);
  EXPECT_NE(message([&] { cross_entropy(logits, zeros({3}, DType::i64)); }).find("cross_entropy: expects logits [N, C]"),
            std::string::npos);
  EXPECT_NE(message([&] { linear(zeros({2, 4}), zeros({3, 5})); })
                .find("linear: input f32[2, 4] on cpu does not match weight f32[3, 5] on cpu"),
            std::string::npos);
  EXPECT_NE(message([&] { embedding(zeros({4, 2}), from_vector(std::vector<int64_t>{4}, {1}, DType::i64)); })
                .find("embedding: index 4 is out of range [0, 4)"),
            std::string::npos);
  EXPECT_NE(message([&] { conv2d(zeros({1, 2, 5, 5}), zeros({3, 4, 3, 3})); }).find("conv2d: expects input [N, C, H, W]"),
            std::string::npos);
  EXPECT_NE(message([&] { layer_norm(zeros({2, 4}), zeros({3}), Tensor()); }).find("layer_norm: parameter f32[3]"),
            std::string::npos);
  EXPECT_NE(message([&] { max_pool2d(zeros({2, 4})); }).find("max_pool2d: expects [N, C, H, W], got f32[2, 4]"),
            std::string::npos);
  EXPECT_NE(message([&] { dropout(zeros({2}), 1.5); }).find("dropout: probability must be in [0, 1]"),
            std::string::npos);
}

// ---- the engine -------------------------------------------------------------------------

TEST(Engine, GradientsAccumulateAcrossBackwardCalls) {
  Tensor w = from_vector({1.f, 2.f, 3.f}, {3});
  w.set_requires_grad(true);
  backward(sum(w * w));
  EXPECT_EQ(w.grad().to_vector<float>(), (std::vector<float>{2, 4, 6}));
  backward(sum(w * 3.0));
  EXPECT_EQ(w.grad().to_vector<float>(), (std::vector<float>{5, 7, 9}));
}

// The engine takes an incoming gradient as the leaf's gradient when nothing
// else sees it, and copies one that something else still holds: here one
// tensor reaches two leaves (add's rule hands the same gradient to both) and
// one is the saved input of a later rule. Accumulating into one leaf's
// gradient in place must change nothing else.
TEST(Engine, LeafGradientsNeverAliasEachOther) {
  Tensor a = from_vector({1.f, 2.f}, {2}), b = from_vector({3.f, 4.f}, {2});
  a.set_requires_grad(true);
  b.set_requires_grad(true);
  backward(sum(a + b));
  EXPECT_FALSE(a.grad().storage() == b.grad().storage());
  backward(sum(a * 3.0));  // adds into a's gradient in place
  EXPECT_EQ(a.grad().to_vector<float>(), (std::vector<float>{4, 4}));
  EXPECT_EQ(b.grad().to_vector<float>(), (std::vector<float>{1, 1}));

  // A gradient the caller still holds (the seed) is not taken.
  Tensor c = from_vector({1.f, 2.f}, {2});
  c.set_requires_grad(true);
  const Tensor seed = from_vector({5.f, 6.f}, {2});
  backward(c, seed);
  backward(c, seed);
  EXPECT_EQ(c.grad().to_vector<float>(), (std::vector<float>{10, 12}));
  EXPECT_EQ(seed.to_vector<float>(), (std::vector<float>{5, 6}));
}

TEST(Engine, SharedSubexpressionsSumTheirGradients) {
  Tensor x = from_vector({2.f}, {1});
  x.set_requires_grad(true);
  const Tensor y = x * x;    // 4
  const Tensor z = y * y + y;  // x^4 + x^2
  backward(sum(z));
  EXPECT_FLOAT_EQ(x.grad().item(), 4 * 8 + 2 * 2);  // 4x^3 + 2x
}

TEST(Engine, RetainGraphAllowsASecondBackward) {
  Tensor x = from_vector({1.f, 2.f}, {2});
  x.set_requires_grad(true);
  const Tensor loss = sum(exp(x));
  backward(loss, Tensor(), true);
  backward(loss);
  EXPECT_FLOAT_EQ(x.grad().to_vector<float>()[0], 2 * std::exp(1.0f));
  try {
    backward(loss);
    FAIL() << "a third backward through a freed graph must throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("retain_graph"), std::string::npos) << e.what();
  }
}

TEST(Engine, RequiresGradPropagatesAndNoGradStopsIt) {
  Tensor a = ones({2}), b = ones({2});
  b.set_requires_grad(true);
  EXPECT_FALSE((a * a).requires_grad());
  EXPECT_TRUE((a * b).requires_grad());
  EXPECT_TRUE((a * b).grad_fn() != nullptr);
  {
    NoGradGuard guard;
    EXPECT_FALSE((a * b).requires_grad());
  }
  EXPECT_TRUE(grad_enabled());
  const Tensor d = detach(b * 2.0);
  EXPECT_FALSE(d.requires_grad());
  EXPECT_THROW(backward(sum(a * a)), Error);
  EXPECT_THROW(backward(b * 2.0), ShapeError);  // non-scalar root without a gradient
  EXPECT_THROW(ones({2}, DType::i64).set_requires_grad(true), DTypeError);
}

TEST(Engine, BackwardWithAGivenGradient) {
  Tensor x = from_vector({1.f, 2.f, 3.f}, {3});
  x.set_requires_grad(true);
  backward(x * 2.0, from_vector({1.f, 10.f, 100.f}, {3}));
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{2, 20, 200}));
}

TEST(Engine, PostAccumulateHooksSeeTheFinalGradientOncePerBackward) {
  Tensor w = from_vector({1.f, 2.f}, {2});
  w.set_requires_grad(true);
  std::vector<std::vector<float>> seen;
  w.autograd_meta().post_accumulate_hooks.push_back(
      [&](const Tensor& p) { seen.push_back(p.grad().to_vector<float>()); });
  // w is used three times: the hook fires once, after all three arrived.
  backward(sum(w * w + w * 3.0));
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0], (std::vector<float>{5, 7}));
}

TEST(Engine, HooksFireInReverseOfForwardOrder) {
  Tensor w1 = from_vector({1.f}, {1}), w2 = from_vector({1.f}, {1}), w3 = from_vector({1.f}, {1});
  std::vector<int> order;
  int id = 1;
  for (Tensor* w : {&w1, &w2, &w3}) {
    w->set_requires_grad(true);
    w->autograd_meta().post_accumulate_hooks.push_back([&order, i = id++](const Tensor&) { order.push_back(i); });
  }
  const Tensor h1 = tanh(w1 * 2.0);
  const Tensor h2 = tanh(h1 * w2);
  const Tensor h3 = tanh(h2 * w3);
  backward(sum(h3));
  EXPECT_EQ(order, (std::vector<int>{3, 2, 1}));
}

// DDP starts a bucket's all-reduce from these hooks: one that fired only
// when the pass ended would leave nothing to overlap. The sinks outlive a
// pass while anything holds its graph (a training loop's last loss, alive
// until the next forward's result replaces it), so the next forward reuses
// sinks made long before its own nodes.
TEST(Engine, AHookFiresOnceItsGradientIsCompleteWhileAnOlderGraphHoldsTheSinks) {
  Tensor w1 = from_vector({0.5f}, {1}), w2 = from_vector({0.5f}, {1}), w3 = from_vector({0.5f}, {1});
  for (Tensor* w : {&w1, &w2, &w3}) w->set_requires_grad(true);
  auto forward = [&] { return sum(tanh(tanh(tanh(w1 * 2.0) * w2) * w3)); };
  Tensor loss = forward();
  backward(loss);
  std::vector<std::string> events;
  w3.autograd_meta().post_accumulate_hooks.push_back([&](const Tensor&) { events.push_back("w3 ready"); });
  set_backward_observer([&](const std::string& node) { events.push_back(node); });
  loss = forward();  // the previous loss (and its graph) lives until here
  backward(loss);
  set_backward_observer(nullptr);
  const auto ready = std::find(events.begin(), events.end(), "w3 ready");
  ASSERT_NE(ready, events.end());
  // The tanh rules of the two inner layers still run after w3's gradient is done.
  EXPECT_EQ(std::count(ready, events.end(), "tanh"), 2) << fmt::format("{}", fmt::join(events, ", "));
}

TEST(Engine, HalfGradientsFlowToF32Leaves) {
  Tensor w = from_vector({0.5f, -1.5f}, {2});
  w.set_requires_grad(true);
  const Tensor wh = to(w, DType::f16);
  const Tensor y = wh * wh;
  EXPECT_EQ(y.dtype(), DType::f16);
  backward(sum(y));
  EXPECT_EQ(w.grad().dtype(), DType::f32);
  EXPECT_EQ(w.grad().to_vector<float>(), (std::vector<float>{1.0f, -3.0f}));
}

}  // namespace
}  // namespace mpt
