// Every op's backward rule against central differences in f64, on random
// shapes with broadcasting and non-contiguous inputs; the forward values of
// the NN ops against naive f64 loops; and the engine itself.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "autograd/function.h"
#include "autograd/ops.h"
#include "tests/gradcheck.h"
#include "tests/layer_norm_ref.h"

namespace mpt {
namespace {

using testing::expect_gradients_match;
using testing::round_to;
using testing::host_f64;
using testing::layer_norm_ref;
using testing::LayerNormRef;
using testing::leaf;
using testing::rel_error;
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
  expect_gradients_match([](const V& v) { return silu(v[0]); }, {x({4, 5}, false, -6, 6)});
  expect_gradients_match([](const V& v) { return pow(v[0], 2.7); }, {x({3, 4}, false, 0.2, 2)});
  expect_gradients_match([](const V& v) { return pow(v[0], v[1]); }, {x({3, 4}, false, 0.2, 2), x({4}, false, -1, 2)});
  // x^0 has gradient 0 everywhere, at 0 too (not 0 * 0^-1 = NaN).
  Tensor zero_and_one = from_vector(std::vector<double>{0.0, 1.0}, {2}, DType::f64).set_requires_grad(true);
  backward(sum(pow(zero_and_one, 0.0)));
  EXPECT_EQ(host_f64(zero_and_one.grad()), (std::vector<double>{0.0, 0.0}));
  // With a tensor exponent, PyTorch's values at x = 0: d/dx is 0 where
  // e = 0 and e * 0^(e-1) otherwise (0 for e = 2, inf for e = 0.5);
  // d/de is 0 where e >= 0.
  Tensor base = from_vector(std::vector<double>{0.0, 0.0, 0.0, 2.0}, {4}, DType::f64).set_requires_grad(true);
  Tensor exponent = from_vector(std::vector<double>{0.0, 2.0, 0.5, 0.0}, {4}, DType::f64).set_requires_grad(true);
  backward(sum(pow(base, exponent)));
  EXPECT_EQ(host_f64(base.grad()), (std::vector<double>{0.0, 0.0, INFINITY, 0.0}));
  EXPECT_EQ(host_f64(exponent.grad()), (std::vector<double>{0.0, 0.0, 0.0, std::log(2.0)}));
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
  // A 0-d tensor reduced over "dimension 0", as PyTorch allows.
  expect_gradients_match([](const V& v) { return mean(sum(v[0]), {0}) * 2.0; }, {x({3})});
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
  // Binary cross-entropy in f64: logits, targets in [0, 1] and per-class
  // positive weights all get their gradients.
  for (Reduction r : {Reduction::mean, Reduction::sum, Reduction::none}) {
    expect_gradients_match([=](const V& v) { return binary_cross_entropy_with_logits(v[0], v[1], r); },
                           {x({4, 3}, false, -4, 4), x({4, 3}, false, 0, 1)});
    expect_gradients_match([=](const V& v) { return binary_cross_entropy_with_logits(v[0], v[1], r, v[2]); },
                           {x({4, 3}, false, -4, 4), x({4, 3}, false, 0, 1), x({3}, false, 0.5, 3)});
  }
}

TEST_F(Gradcheck, LayerNormEmbeddingDropout) {
  TRACE_SEED();
  expect_gradients_match([](const V& v) { return to(layer_norm(v[0], v[1], v[2]), DType::f64); },
                         {x({2, 3, 6}, false, -2, 2), x({6}, false, 0.5, 1.5), x({6})}, 2e-3, 1e-3);
  // One vector, no batch dimensions.
  expect_gradients_match([](const V& v) { return to(layer_norm(v[0], v[1], v[2]), DType::f64); },
                         {x({6}, false, -2, 2), x({6}, false, 0.5, 1.5), x({6})}, 2e-3, 1e-3);
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

// Sizes of 0 (an empty batch, no features in or out) go through forward
// and backward with the gradients' zeros, as in PyTorch.
TEST_F(Gradcheck, EmptySizesFlowThroughMatmulLinearAndFlatten) {
  TRACE_SEED();
  auto product = [](const V& v) { return matmul(v[0], v[1]); };
  expect_gradients_match(product, {x({2, 3, 4}), x({4, 0})});
  expect_gradients_match(product, {x({2, 3, 0}), x({0, 5})});
  auto affine = [](const V& v) { return linear(v[0], v[1], v[2]); };
  expect_gradients_match(affine, {x({2, 0}), x({3, 0}), x({3})});  // no input features: the bias alone
  expect_gradients_match(affine, {x({2, 4}), x({0, 4}), x({0})});  // no output features
  expect_gradients_match(affine, {x({0, 4}), x({3, 4}), x({3})});  // an empty batch
  EXPECT_EQ(flatten(x({0, 2, 3, 3}), 1).shape(), (Shape{0, 18}));
  expect_gradients_match([](const V& v) { return flatten(v[0], 1); }, {x({0, 2, 3, 3})});
}

TEST_F(Gradcheck, Attention) {
  TRACE_SEED();
  for (bool causal : {true, false}) {
    auto attention = [=](const V& v) { return scaled_dot_product_attention(v[0], v[1], v[2], causal); };
    expect_gradients_match(attention, {x({2, 2, 5, 3}), x({2, 2, 5, 3}), x({2, 2, 5, 3})});
    expect_gradients_match(attention, {x({2, 2, 3, 3}), x({2, 2, 5, 3}), x({2, 2, 5, 3})});  // fewer queries
  }
  expect_gradients_match([](const V& v) { return scaled_dot_product_attention(v[0], v[1], v[2], false); },
                         {x({1, 2, 4, 3}), x({1, 2, 2, 3}), x({1, 2, 2, 3})});  // more queries, no mask
  // A learned additive mask gets its gradient; a u8 mask, with the causal one.
  expect_gradients_match(
      [](const V& v) { return scaled_dot_product_attention(v[0], v[1], v[2], false, std::nullopt, v[3]); },
      {x({2, 2, 3, 3}), x({2, 2, 5, 3}), x({2, 2, 5, 3}), x({2, 1, 3, 5})});
  const Tensor keep = from_vector(std::vector<uint8_t>{1, 0, 1, 1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 0}, {3, 5}, DType::u8);
  expect_gradients_match(
      [=](const V& v) { return scaled_dot_product_attention(v[0], v[1], v[2], true, std::nullopt, keep); },
      {x({2, 2, 3, 3}), x({2, 2, 5, 3}), x({2, 2, 5, 3})});
}

// ---- forward values of the composite ops ---------------------------------------------

// Causal or not, with the default scale 1 / sqrt(d) or an explicit one, and
// with as many queries as keys or fewer (a causal mask then puts them at the
// keys' end: query i sees keys up to 4 - tq + i).
TEST(AutogradForward, AttentionMatchesExplicitMath) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  const int tk = 4;
  const Tensor k = randn({1, 1, tk, 2}, DType::f64, kCPU, &gen), v = randn({1, 1, tk, 2}, DType::f64, kCPU, &gen);
  const auto kv = k.to_vector<double>(), vv = v.to_vector<double>();
  for (int tq : {4, 3, 1}) {
    const Tensor q = randn({1, 1, tq, 2}, DType::f64, kCPU, &gen);
    const auto qv = q.to_vector<double>();
    for (bool causal : {true, false})
      for (std::optional<double> scale : {std::optional<double>(), std::optional<double>(0.3)}) {
        SCOPED_TRACE(::testing::Message() << tq << " queries, causal " << causal << ", scale " << scale.value_or(-1));
        const auto y = scaled_dot_product_attention(q, k, v, causal, scale).to_vector<double>();
        ASSERT_EQ(y.size(), static_cast<size_t>(tq * 2));
        const double s = scale.value_or(1.0 / std::sqrt(2.0));
        for (int i = 0; i < tq; ++i) {
          const int last = causal ? tk - tq + i : tk - 1;
          std::vector<double> w(tk, 0.0);
          double total = 0;
          for (int j = 0; j <= last; ++j) {
            w[j] = std::exp((qv[i * 2] * kv[j * 2] + qv[i * 2 + 1] * kv[j * 2 + 1]) * s);
            total += w[j];
          }
          for (int d = 0; d < 2; ++d) {
            double ref = 0;
            for (int j = 0; j <= last; ++j) ref += w[j] / total * vv[j * 2 + d];
            EXPECT_NEAR(y[i * 2 + d], ref, 1e-12);
          }
        }
      }
  }
}

// Masks: a u8 one leaves out the keys it zeroes (per batch here, broadcast
// over the heads), a float one is added to the scores (broadcast over batch
// and heads); with causal, both apply.
TEST(AutogradForward, AttentionMasksMatchExplicitMath) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  const int64_t B = 2, H = 2, tq = 3, tk = 5, d = 4;
  const Tensor q = randn({B, H, tq, d}, DType::f64, kCPU, &gen), k = randn({B, H, tk, d}, DType::f64, kCPU, &gen),
               v = randn({B, H, tk, d}, DType::f64, kCPU, &gen);
  std::mt19937_64 coin(seed);
  std::vector<uint8_t> keep_values(static_cast<size_t>(B * tq * tk));
  for (size_t i = 0; i < keep_values.size(); ++i)  // key 0 always kept, so no query is left without keys
    keep_values[i] = i % tk == 0 || coin() % 2 == 0;
  const Tensor keep = from_vector(keep_values, {B, 1, tq, tk}, DType::u8);
  const Tensor bias = randn({tq, tk}, DType::f64, kCPU, &gen);
  const auto qv = q.to_vector<double>(), kv = k.to_vector<double>(), vv = v.to_vector<double>(),
             bv = bias.to_vector<double>();
  const double s = 1.0 / std::sqrt(static_cast<double>(d));
  for (bool causal : {false, true})
    for (bool additive : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "causal " << causal << (additive ? ", float mask" : ", u8 mask"));
      const auto y = scaled_dot_product_attention(q, k, v, causal, std::nullopt, additive ? bias : keep)
                         .to_vector<double>();
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t i = 0; i < tq; ++i) {
            std::vector<double> w(tk, 0.0);
            double total = 0;
            for (int64_t j = 0; j < tk; ++j) {
              if (causal && j > tk - tq + i) continue;
              if (!additive && !keep_values[(b * tq + i) * tk + j]) continue;
              double score = 0;
              for (int64_t e = 0; e < d; ++e) score += qv[((b * H + h) * tq + i) * d + e] * kv[((b * H + h) * tk + j) * d + e];
              w[j] = std::exp(score * s + (additive ? bv[i * tk + j] : 0.0));
              total += w[j];
            }
            for (int64_t e = 0; e < d; ++e) {
              double ref = 0;
              for (int64_t j = 0; j < tk; ++j) ref += w[j] / total * vv[((b * H + h) * tk + j) * d + e];
              EXPECT_NEAR(y[((b * H + h) * tq + i) * d + e], ref, 1e-12) << b << " " << h << " " << i << " " << e;
            }
          }
    }
}

// A query whose keys are all masked out (a u8 row of zeros; a float row of
// -inf; left padding under the causal mask) gives zeros and passes no
// gradient, as PyTorch's attention does; the other queries are untouched.
TEST(AutogradForward, AQueryWithEveryKeyMaskedGivesZeros) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  const double inf = std::numeric_limits<double>::infinity();
  // Each: the mask, causal or not, and the (query) rows it leaves without keys.
  struct Case {
    const char* name;
    Tensor mask;
    bool causal;
    std::vector<int64_t> dead;
  };
  const std::vector<Case> cases = {
      {"u8", from_vector(std::vector<uint8_t>{1, 0, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1}, {3, 4}, DType::u8), false, {1}},
      {"float", from_vector(std::vector<double>{0, -inf, 0.5, 1, -inf, -inf, -inf, -inf, 2, 0, 0, -1}, {3, 4},
                            DType::f64),
       false, {1}},
      // Keys 0 and 1 are padding: the causal mask leaves query 0 (key
      // position 1) with padding alone.
      {"left padding", from_vector(std::vector<uint8_t>{0, 0, 1, 1}, {4}, DType::u8), true, {0}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const Tensor q = randn({1, 2, 3, 4}, DType::f64, kCPU, &gen).set_requires_grad(true);
    const Tensor k = randn({1, 2, 4, 4}, DType::f64, kCPU, &gen).set_requires_grad(true);
    const Tensor v = randn({1, 2, 4, 4}, DType::f64, kCPU, &gen).set_requires_grad(true);
    const Tensor y = scaled_dot_product_attention(q, k, v, c.causal, std::nullopt, c.mask);
    backward(sum(y));
    for (const Tensor& t : {y, q.grad(), k.grad(), v.grad()}) {
      const std::vector<double> values = host_f64(t);
      for (double x : values) ASSERT_TRUE(std::isfinite(x)) << "a NaN or inf in " << describe(t);
    }
    const std::vector<double> out = host_f64(y), gq = host_f64(q.grad());
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t i = 0; i < 3; ++i) {
        const bool dead = std::find(c.dead.begin(), c.dead.end(), i) != c.dead.end();
        for (int64_t e = 0; e < 4; ++e) {
          const size_t at = static_cast<size_t>((h * 3 + i) * 4 + e);
          if (dead) {
            EXPECT_EQ(out[at], 0.0) << "head " << h << " query " << i;
            EXPECT_EQ(gq[at], 0.0) << "head " << h << " query " << i;
          } else {
            EXPECT_NE(out[at], 0.0) << "head " << h << " query " << i;
          }
        }
      }
  }
  // Gradients where some queries have keys and one has none.
  const Tensor keep = from_vector(std::vector<uint8_t>{1, 1, 0, 0, 0, 0, 0, 1, 0}, {3, 3}, DType::u8);
  expect_gradients_match(
      [=](const V& v) { return scaled_dot_product_attention(v[0], v[1], v[2], false, std::nullopt, keep); },
      {testing::leaf({1, 1, 3, 2}, gen), testing::leaf({1, 1, 3, 2}, gen), testing::leaf({1, 1, 3, 2}, gen)});
}

// silu(x) = x / (1 + e^-x); in 16 bits the f32 value and gradient rounded once.
TEST(AutogradForward, SiluMatchesDefinitionAndRoundsOnce) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  const Tensor x = randn({50}, DType::f64, kCPU, &gen);
  const std::vector<double> xv = host_f64(x), y = host_f64(silu(x));
  for (size_t i = 0; i < xv.size(); ++i) EXPECT_NEAR(y[i], xv[i] / (1 + std::exp(-xv[i])), 1e-15) << xv[i];
  for (DType dt : {DType::f16, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor x16 = prim::to(randn({200}, DType::f32, kCPU, &gen), dt).set_requires_grad(true);
    const Tensor x32 = prim::to(x16, DType::f32).set_requires_grad(true);
    const Tensor y16 = silu(x16), y32 = silu(x32);
    ASSERT_EQ(y16.dtype(), dt);
    EXPECT_EQ(host_f64(y16), host_f64(prim::to(y32, dt)));
    backward(sum(y16));
    backward(sum(y32));
    EXPECT_EQ(host_f64(x16.grad()), host_f64(prim::to(x32.grad(), dt)));
  }
}

// A root's gradient of another float dtype is converted, as in PyTorch.
TEST(AutogradForward, ARootGradientOfAnotherFloatDtypeIsConverted) {
  const Tensor w = from_vector(std::vector<float>{1, -2, 3}, {3}).set_requires_grad(true);
  backward(mul(w, w), from_vector(std::vector<double>{1, 0.5, 2}, {3}, DType::f64));
  EXPECT_EQ(w.grad().dtype(), DType::f32);
  EXPECT_EQ(w.grad().to_vector<double>(), (std::vector<double>{2, -2, 12}));
}

// A causal mask in 16 bits past the lengths where the dtype holds every
// position: no query sees a key after it (in bf16, positions 256 and 257
// round to one value).
TEST(AutogradForward, SixteenBitCausalAttentionNeverSeesTheNextKey) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  const int64_t t = 300;
  for (DType dt : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor q = randn({1, 1, t, 8}, dt, kCPU, &gen), k = randn({1, 1, t, 8}, dt, kCPU, &gen);
    const Tensor v = randn({1, 1, t, 8}, dt, kCPU, &gen);
    const Tensor changed = prim::clone(v);
    prim::fill_(prim::slice(changed, 2, 257, 258), 100.0);  // key 257's value only
    const Tensor before = scaled_dot_product_attention(q, k, v, true);
    const Tensor after = scaled_dot_product_attention(q, k, changed, true);
    EXPECT_EQ(prim::slice(before, 2, 0, 257).to_vector<double>(), prim::slice(after, 2, 0, 257).to_vector<double>())
        << "a query before position 257 saw its value";
    EXPECT_NE(prim::slice(before, 2, 257, 258).to_vector<double>(), prim::slice(after, 2, 257, 258).to_vector<double>());
  }
}

// An embedding row that many tokens share gets the sum of their gradients
// rounded once to the table's dtype, not a 16-bit running sum (which in
// bf16 stops growing near 0.5 for steps of 1e-3).
TEST(AutogradForward, SixteenBitEmbeddingGradientsSumInF32) {
  for (DType dt : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor table = zeros({10, 4}, dt).set_requires_grad(true);
    const Tensor indices = full({2000}, 3.0, DType::i64);
    backward(sum(mul(embedding(table, indices), full({2000, 4}, 1e-3, dt))));
    const std::vector<double> row = prim::slice(table.grad(), 0, 3, 4).to_vector<double>();
    const double exact = 2000 * static_cast<double>(prim::to(full({}, 1e-3, dt), DType::f64).item());
    for (double v : row) EXPECT_NEAR(v, exact, exact * 1e-2);
    EXPECT_EQ(prim::slice(table.grad(), 0, 0, 1).to_vector<double>(), std::vector<double>(4, 0.0));
  }
}

// A bias gradient over four million rows is their sum to f32's precision,
// whether it comes from the weight gradient's epilogue or from a sum of its
// own (the weight frozen).
TEST(AutogradForward, ABiasGradientOverMillionsOfRowsIsExactEitherWay) {
  const int64_t n = int64_t(1) << 22;
  const Tensor x = ones({n, 1});
  const Tensor upstream = full({n, 1}, 0.01);
  const double exact = n * static_cast<double>(0.01f);
  for (bool weight_wants_a_gradient : {true, false}) {
    SCOPED_TRACE(weight_wants_a_gradient ? "epilogue" : "own sum");
    const Tensor w = ones({1, 1}).set_requires_grad(weight_wants_a_gradient);
    const Tensor b = zeros({1}).set_requires_grad(true);
    backward(sum(mul(linear(x, w, b), upstream)));
    EXPECT_NEAR(b.grad().item(), exact, exact * 1e-6);
  }
}

// Softmax and log-softmax in 16 bits on the CPU against the f64 result of
// the same rounded inputs: a few roundings of the 16-bit type (the
// exponentials, the sum, the division), no more.
TEST(AutogradForward, SixteenBitSoftmaxStaysWithinAFewUlpsOfF64) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  for (DType dt : {DType::f16, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    const double ulp = dt == DType::f16 ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7);
    const Tensor x = prim::mul_scalar(randn({16, 37}, dt, kCPU, &gen), 3.0);
    const Tensor exact = prim::to(x, DType::f64);
    const std::vector<double> got = prim::to(softmax(x, 1), DType::f64).to_vector<double>(),
                              want = softmax(exact, 1).to_vector<double>();
    for (size_t i = 0; i < want.size(); ++i) ASSERT_LE(std::fabs(got[i] - want[i]), 4 * ulp * want[i] + 1e-7) << i;
    const std::vector<double> got_log = prim::to(log_softmax(x, 1), DType::f64).to_vector<double>(),
                              want_log = log_softmax(exact, 1).to_vector<double>();
    for (size_t i = 0; i < want_log.size(); ++i)
      ASSERT_LE(std::fabs(got_log[i] - want_log[i]), 4 * ulp * (1 + std::fabs(want_log[i]))) << i;
  }
}

// ---- layer norm against its definition in f64 ----------------------------------------

// Each value of `got` (a norm computed in f32 and rounded once to dt) is the
// exact norm rounded to dt, or the value of dt on its other side where the
// exact norm lies within the f32 math's error of halfway between the two.
// That error is bounded by 1e-5 of |w| (1 + |xhat|) plus 1e-6 of |b|: far
// above the f32 math's (about 1e-7 of those), far below a 16-bit step.
void expect_rounded_norm(const std::vector<double>& got, const LayerNormRef& ref, const std::vector<double>& w,
                         const std::vector<double>& b, DType dt, const std::string& what) {
  ASSERT_EQ(got.size(), ref.y.size()) << what;
  const size_t d = w.size();
  int64_t wrong = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double want = round_to(ref.y[i], dt);
    const double slack = 1e-5 * std::fabs(w[i % d]) * (1 + std::fabs(ref.xhat[i])) + 1e-6 * std::fabs(b[i % d]);
    if (std::fabs(got[i] - ref.y[i]) <= std::fabs(want - ref.y[i]) + slack) continue;
    if (wrong++ == 0)
      ADD_FAILURE() << what << ": element " << i << " is " << got[i] << "; the exact norm " << ref.y[i]
                    << " rounds to " << want;
  }
  EXPECT_EQ(wrong, 0) << what;
}

// A norm written straight in 16 bits (what a matmul under autocast would
// cast it to) is the norm computed in f32 and rounded once: against the
// exact norm in f64, rounded to 16 bits. Its gradients are the norm's, fed
// the 16-bit output gradient. A 16-bit input asked for f32 gets the f32 norm
// of its values. (The GPU's fused kernel is held to the CPU in
// test_cuda_autograd.)
TEST(AutogradForward, LayerNormWrittenInSixteenBitsIsTheNormRoundedOnce) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  const int64_t d = 384;
  for (DType low : {DType::f16, DType::bf16}) {
    SCOPED_TRACE(dtype_name(low));
    Tensor x = randn({3, 5, d}, DType::f32, kCPU, &gen), w = randn({d}, DType::f32, kCPU, &gen),
           b = randn({d}, DType::f32, kCPU, &gen);
    const Tensor dy = randn({3, 5, d}, low, kCPU, &gen);
    for (Tensor* t : {&x, &w, &b}) t->set_requires_grad(true);
    const Tensor y = layer_norm(x, w, b, 1e-5, low);
    ASSERT_EQ(y.dtype(), low);
    backward(y, dy);
    const std::vector<double> wv = host_f64(w), bv = host_f64(b);
    const LayerNormRef ref = layer_norm_ref(host_f64(x), wv, bv, d, 1e-5, host_f64(dy));
    expect_rounded_norm(host_f64(y), ref, wv, bv, low, "forward");
    EXPECT_LE(rel_error(host_f64(x.grad()), ref.gx), 1e-4) << "gradient of x";
    EXPECT_LE(rel_error(host_f64(w.grad()), ref.gw), 1e-4) << "gradient of the weight";
    EXPECT_LE(rel_error(host_f64(b.grad()), ref.gb), 1e-4) << "gradient of the bias";

    const Tensor x16 = prim::to(x, low), w16 = prim::to(w, low), b16 = prim::to(b, low);
    const Tensor asked = layer_norm(x16, w16, b16, 1e-5, DType::f32);
    ASSERT_EQ(asked.dtype(), DType::f32);
    const std::vector<double> w16v = host_f64(w16), b16v = host_f64(b16);
    expect_rounded_norm(host_f64(asked), layer_norm_ref(host_f64(x16), w16v, b16v, d, 1e-5), w16v, b16v, DType::f32,
                        "a 16-bit input asked for f32");
  }
}

// The norm with its input passed on beside it: the first result is x itself
// (its values and storage), the second the norm (f32, or rounded once to
// f16), and x's gradient is the sum of both paths'. The norm's output
// gradient reaches it in the norm's dtype. (The GPU's single node is held to
// the CPU in test_cuda_autograd.)
TEST(AutogradForward, LayerNormWithSkipIsTheInputAndTheNorm) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  const int64_t d = 96;
  for (DType out : {DType::f32, DType::f16}) {
    SCOPED_TRACE(::testing::Message() << "into " << dtype_name(out));
    auto draw = [&](const Shape& s) { return randn(s, DType::f32, kCPU, &gen); };
    Tensor x = draw({4, 7, d}), w = draw({d}), b = draw({d});
    const Tensor dskip = draw({4, 7, d}), dnorm = draw({4, 7, d});
    for (Tensor* t : {&x, &w, &b}) t->set_requires_grad(true);
    const auto [skip, normed] = layer_norm_with_skip(x, w, b, 1e-5, out);
    ASSERT_EQ(skip.dtype(), DType::f32);
    ASSERT_EQ(normed.dtype(), out);
    EXPECT_EQ(skip.storage(), x.storage());
    EXPECT_EQ(host_f64(skip), host_f64(x));
    backward(sum(skip * dskip) + sum(to(normed, DType::f32) * dnorm));

    std::vector<double> g = host_f64(dnorm);
    for (double& v : g) v = round_to(v, out);
    const std::vector<double> wv = host_f64(w), bv = host_f64(b);
    const LayerNormRef ref = layer_norm_ref(host_f64(x), wv, bv, d, 1e-5, g);
    expect_rounded_norm(host_f64(normed), ref, wv, bv, out, "norm");
    std::vector<double> gx = ref.gx;
    const std::vector<double> ds = host_f64(dskip);
    for (size_t i = 0; i < gx.size(); ++i) gx[i] += ds[i];
    EXPECT_LE(rel_error(host_f64(x.grad()), gx), 1e-4) << "gradient of x";
    EXPECT_LE(rel_error(host_f64(w.grad()), ref.gw), 1e-4) << "gradient of the weight";
    EXPECT_LE(rel_error(host_f64(b.grad()), ref.gb), 1e-4) << "gradient of the bias";
  }
}

TEST(AutogradForward, LayerNormMatchesItsDefinition) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  const int64_t d = 17;
  for (DType dt : {DType::f64, DType::f32})
    for (double eps : {1e-5, 0.3})  // a large eps shows whether it is added where it belongs
      for (int params = 0; params < 4; ++params) {
        const bool with_w = params & 1, with_b = params & 2;
        SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " eps " << eps << " weight " << with_w << " bias "
                                          << with_b);
        const Tensor x = prim::mul_scalar(randn({4, 3, d}, dt, kCPU, &gen), 3.0);
        const Tensor w = with_w ? randn({d}, dt, kCPU, &gen) : Tensor();
        const Tensor b = with_b ? randn({d}, dt, kCPU, &gen) : Tensor();
        const LayerNormRef ref = layer_norm_ref(host_f64(x), with_w ? host_f64(w) : std::vector<double>{},
                                                with_b ? host_f64(b) : std::vector<double>{}, d, eps);
        const Tensor y = layer_norm(x, w, b, eps);
        ASSERT_EQ(y.dtype(), dt);
        EXPECT_LE(rel_error(host_f64(y), ref.y), dt == DType::f64 ? 1e-12 : 1e-5);
      }
}

// ---- forward values of the NN ops against naive f64 loops ------------------------------

// [N, O, HO, WO]: out[n, o, i, j] = b[o] + sum over c, p, q of
// x[n, c, i * stride - pad + p * dilation, j * ...] * w[o, c, p, q], with
// zeros outside x (b empty: no bias).
std::vector<double> conv2d_ref(const std::vector<double>& x, const Shape& xs, const std::vector<double>& w,
                               const Shape& ws, const std::vector<double>& b, const Conv2dParams& p,
                               Shape& out_shape) {
  const int64_t N = xs[0], C = xs[1], H = xs[2], W = xs[3], O = ws[0], KH = ws[2], KW = ws[3];
  const int64_t HO = (H + 2 * p.pad_h - p.dilation_h * (KH - 1) - 1) / p.stride_h + 1;
  const int64_t WO = (W + 2 * p.pad_w - p.dilation_w * (KW - 1) - 1) / p.stride_w + 1;
  out_shape = {N, O, HO, WO};
  std::vector<double> out(static_cast<size_t>(N * O * HO * WO));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < O; ++o)
      for (int64_t i = 0; i < HO; ++i)
        for (int64_t j = 0; j < WO; ++j) {
          double acc = b.empty() ? 0.0 : b[o];
          for (int64_t c = 0; c < C; ++c)
            for (int64_t kh = 0; kh < KH; ++kh)
              for (int64_t kw = 0; kw < KW; ++kw) {
                const int64_t h = i * p.stride_h - p.pad_h + kh * p.dilation_h;
                const int64_t v = j * p.stride_w - p.pad_w + kw * p.dilation_w;
                if (h < 0 || h >= H || v < 0 || v >= W) continue;
                acc += x[((n * C + c) * H + h) * W + v] * w[((o * C + c) * KH + kh) * KW + kw];
              }
          out[((n * O + o) * HO + i) * WO + j] = acc;
        }
  return out;
}

TEST(AutogradForward, Conv2dMatchesNaiveLoops) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  // {stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w}
  const Conv2dParams geometries[] = {{}, {2, 1, 1, 2, 1, 1}, {1, 2, 2, 1, 2, 3}, {3, 2, 0, 1, 1, 2}};
  for (DType dt : {DType::f64, DType::f32})
    for (const Conv2dParams& p : geometries) {
      SCOPED_TRACE(fmt::format("{} stride ({}, {}) pad ({}, {}) dilation ({}, {})", dtype_name(dt), p.stride_h,
                               p.stride_w, p.pad_h, p.pad_w, p.dilation_h, p.dilation_w));
      const Tensor x = randn({2, 3, 11, 10}, dt, kCPU, &gen), w = randn({4, 3, 3, 2}, dt, kCPU, &gen),
                   b = randn({4}, dt, kCPU, &gen);
      for (bool with_bias : {true, false}) {
        Shape shape;
        const std::vector<double> want = conv2d_ref(host_f64(x), x.shape(), host_f64(w), w.shape(),
                                                    with_bias ? host_f64(b) : std::vector<double>{}, p, shape);
        const Tensor y = conv2d(x, w, with_bias ? b : Tensor(), p);
        ASSERT_EQ(y.shape(), shape);
        EXPECT_LE(rel_error(host_f64(y), want), dt == DType::f64 ? 1e-12 : 1e-5) << "bias " << with_bias;
      }
    }
}

// [N, C, HO, WO]: the maximum of each window, padding never chosen.
std::vector<double> max_pool2d_ref(const std::vector<double>& x, const Shape& xs, const Pool2dParams& p,
                                   Shape& out_shape) {
  const int64_t NC = xs[0] * xs[1], H = xs[2], W = xs[3];
  const int64_t HO = (H + 2 * p.pad_h - p.kernel_h) / p.stride_h + 1;
  const int64_t WO = (W + 2 * p.pad_w - p.kernel_w) / p.stride_w + 1;
  out_shape = {xs[0], xs[1], HO, WO};
  std::vector<double> out(static_cast<size_t>(NC * HO * WO));
  for (int64_t plane = 0; plane < NC; ++plane)
    for (int64_t i = 0; i < HO; ++i)
      for (int64_t j = 0; j < WO; ++j) {
        double m = -INFINITY;
        for (int64_t kh = 0; kh < p.kernel_h; ++kh)
          for (int64_t kw = 0; kw < p.kernel_w; ++kw) {
            const int64_t h = i * p.stride_h - p.pad_h + kh, v = j * p.stride_w - p.pad_w + kw;
            if (h >= 0 && h < H && v >= 0 && v < W) m = std::max(m, x[(plane * H + h) * W + v]);
          }
        out[(plane * HO + i) * WO + j] = m;
      }
  return out;
}

TEST(AutogradForward, MaxPool2dMatchesNaiveLoops) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  // {kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w}
  const Pool2dParams geometries[] = {{}, {3, 3, 2, 2, 1, 1}, {2, 3, 1, 2, 1, 1}, {3, 2, 3, 1, 0, 1}};
  for (DType dt : {DType::f64, DType::f32})
    for (const Pool2dParams& p : geometries) {
      SCOPED_TRACE(fmt::format("{} kernel {}x{} stride ({}, {}) pad ({}, {})", dtype_name(dt), p.kernel_h, p.kernel_w,
                               p.stride_h, p.stride_w, p.pad_h, p.pad_w));
      const Tensor x = randn({2, 3, 9, 8}, dt, kCPU, &gen);
      Shape shape;
      const std::vector<double> want = max_pool2d_ref(host_f64(x), x.shape(), p, shape);
      const Tensor y = max_pool2d(x, p);
      ASSERT_EQ(y.shape(), shape);
      EXPECT_EQ(host_f64(y), want);  // a maximum is one of the inputs: exact
    }
}

// A batch large enough that the CPU shares its images (convolution) and
// planes (pooling) out over threads: the forward results and, through
// backward of sum(y * r), the gradients of input and weight against naive
// f64 loops (the weight's gradient sums every thread's images). 50 images
// of 16x16 make 13 groups of 4 side by side in one product (cpu_conv.cpp),
// the last of 2. On one CPU nothing is split and the same checks hold.
TEST(AutogradForward, ConvolutionAndPoolingSplitOverThreadsMatchNaiveLoops) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  const int64_t N = 50, C = 8, H = 16, W = 16, O = 16, K = 3;
  const Conv2dParams p{.pad_h = 1, .pad_w = 1};
  Tensor x = randn({N, C, H, W}, DType::f32, kCPU, &gen).set_requires_grad(true);
  Tensor w = randn({O, C, K, K}, DType::f32, kCPU, &gen).set_requires_grad(true);
  const Tensor y = conv2d(x, w, Tensor(), p);
  Shape shape;
  const std::vector<double> xs = host_f64(x), ws = host_f64(w);
  EXPECT_LE(rel_error(host_f64(y), conv2d_ref(xs, x.shape(), ws, w.shape(), {}, p, shape)), 1e-5);
  const Tensor r = randn(y.shape(), DType::f32, kCPU, &gen);
  backward(sum(mul(y, r)));
  // d/dx and d/dw of sum(y * r): each product x * w * r, credited to both.
  const std::vector<double> rs = host_f64(r);
  std::vector<double> dx(xs.size(), 0.0), dw(ws.size(), 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < O; ++o)
      for (int64_t i = 0; i < H; ++i)
        for (int64_t j = 0; j < W; ++j) {
          const double g = rs[static_cast<size_t>(((n * O + o) * H + i) * W + j)];
          for (int64_t c = 0; c < C; ++c)
            for (int64_t kh = 0; kh < K; ++kh)
              for (int64_t kw = 0; kw < K; ++kw) {
                const int64_t h = i - 1 + kh, v = j - 1 + kw;
                if (h < 0 || h >= H || v < 0 || v >= W) continue;
                const auto xi = static_cast<size_t>(((n * C + c) * H + h) * W + v);
                const auto wi = static_cast<size_t>(((o * C + c) * K + kh) * K + kw);
                dx[xi] += g * ws[wi];
                dw[wi] += g * xs[xi];
              }
        }
  EXPECT_LE(rel_error(host_f64(x.grad()), dx), 1e-5);
  EXPECT_LE(rel_error(host_f64(w.grad()), dw), 1e-5);

  Tensor z = randn({64, 16, 12, 12}, DType::f32, kCPU, &gen).set_requires_grad(true);
  const Tensor pooled = max_pool2d(z, Pool2dParams{});
  EXPECT_EQ(host_f64(pooled), max_pool2d_ref(host_f64(z), z.shape(), Pool2dParams{}, shape));
  const Tensor rp = randn(pooled.shape(), DType::f32, kCPU, &gen);
  backward(sum(mul(pooled, rp)));
  // Each window's r goes to its maximum (random values: no ties).
  const std::vector<double> zs = host_f64(z), rps = host_f64(rp);
  std::vector<double> dz(zs.size(), 0.0);
  for (int64_t plane = 0; plane < 64 * 16; ++plane)
    for (int64_t i = 0; i < 6; ++i)
      for (int64_t j = 0; j < 6; ++j) {
        size_t best = 0;
        for (int64_t kh = 0; kh < 2; ++kh)
          for (int64_t kw = 0; kw < 2; ++kw) {
            const auto at = static_cast<size_t>((plane * 12 + 2 * i + kh) * 12 + 2 * j + kw);
            if ((kh == 0 && kw == 0) || zs[at] > zs[best]) best = at;
          }
        dz[best] += rps[static_cast<size_t>((plane * 6 + i) * 6 + j)];
      }
  EXPECT_EQ(host_f64(z.grad()), dz);
}

// softmax (or log_softmax) of a contiguous block of shape s along dim (>= 0),
// the maximum subtracted first.
std::vector<double> softmax_ref(const std::vector<double>& x, const Shape& s, int64_t dim, bool log) {
  int64_t inner = 1;
  for (size_t d = static_cast<size_t>(dim) + 1; d < s.size(); ++d) inner *= s[d];
  const int64_t n = s[dim], outer = static_cast<int64_t>(x.size()) / (n * inner);
  std::vector<double> out(x.size());
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = 0; i < inner; ++i) {
      auto at = [&](int64_t k) { return (o * n + k) * inner + i; };
      double mx = -INFINITY, z = 0;
      for (int64_t k = 0; k < n; ++k) mx = std::max(mx, x[at(k)]);
      for (int64_t k = 0; k < n; ++k) z += std::exp(x[at(k)] - mx);
      for (int64_t k = 0; k < n; ++k)
        out[at(k)] = log ? x[at(k)] - mx - std::log(z) : std::exp(x[at(k)] - mx) / z;
    }
  return out;
}

TEST(AutogradForward, SoftmaxAndLogSoftmaxMatchNaiveLoops) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  for (DType dt : {DType::f64, DType::f32}) {
    const Tensor x = rand({3, 4, 5}, dt, kCPU, &gen, -6.0, 6.0);
    for (int64_t dim : {0, 1, 2, -1}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " dim " << dim);
      const int64_t d = dim < 0 ? dim + 3 : dim;
      const double tol = dt == DType::f64 ? 1e-12 : 1e-5;
      const Tensor y = softmax(x, dim), ly = log_softmax(x, dim);
      ASSERT_EQ(y.dtype(), dt);
      ASSERT_EQ(ly.dtype(), dt);
      EXPECT_LE(rel_error(host_f64(y), softmax_ref(host_f64(x), x.shape(), d, false)), tol) << "softmax";
      EXPECT_LE(rel_error(host_f64(ly), softmax_ref(host_f64(x), x.shape(), d, true)), tol) << "log_softmax";
    }
  }
}

TEST(AutogradForward, MseLossMatchesNaiveLoopsForEachReduction) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  for (DType dt : {DType::f64, DType::f32}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor a = randn({3, 4, 5}, dt, kCPU, &gen), b = randn({3, 4, 5}, dt, kCPU, &gen);
    const std::vector<double> av = host_f64(a), bv = host_f64(b);
    std::vector<double> sq(av.size());
    double total = 0;
    for (size_t i = 0; i < av.size(); ++i) total += sq[i] = (av[i] - bv[i]) * (av[i] - bv[i]);
    const double tol = dt == DType::f64 ? 1e-12 : 1e-5;
    const Tensor none = mse_loss(a, b, Reduction::none);
    ASSERT_EQ(none.shape(), a.shape());
    EXPECT_LE(rel_error(host_f64(none), sq), tol) << "none";
    const Tensor summed = mse_loss(a, b, Reduction::sum), averaged = mse_loss(a, b, Reduction::mean);
    ASSERT_EQ(summed.numel(), 1);
    ASSERT_EQ(averaged.numel(), 1);
    const double n = static_cast<double>(av.size());
    EXPECT_NEAR(summed.item(), total, tol * total) << "sum";
    EXPECT_NEAR(averaged.item(), total / n, tol * total / n) << "mean";
    EXPECT_EQ(mse_loss(a, b).item(), averaged.item()) << "the default reduction is the mean";
  }
}

// -[p y log(sigmoid(x)) + (1 - y) log(1 - sigmoid(x))], with log(sigmoid)
// written stably for the reference; logits up to +-1000 stay finite, and
// 16-bit logits give an f32 loss.
TEST(AutogradForward, BinaryCrossEntropyWithLogitsMatchesDefinition) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  auto log_sigmoid = [](double x) { return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x)); };
  const std::vector<double> xs{-1000, -30, -2.5, -0.1, 0, 0.3, 4, 40, 1000};
  const int64_t n = static_cast<int64_t>(xs.size());
  const Tensor x = from_vector(xs, {n / 3, 3}, DType::f64);
  const Tensor y = rand({n / 3, 3}, DType::f64, kCPU, &gen, 0, 1);
  const Tensor pw = from_vector(std::vector<double>{0.5, 1, 3}, {3}, DType::f64);
  const std::vector<double> yv = host_f64(y), pv = host_f64(pw);
  for (bool weighted : {false, true}) {
    SCOPED_TRACE(weighted ? "pos_weight" : "no pos_weight");
    std::vector<double> expected(xs.size());
    double total = 0;
    for (size_t i = 0; i < xs.size(); ++i) {
      const double p = weighted ? pv[i % 3] : 1.0;
      total += expected[i] = -(p * yv[i] * log_sigmoid(xs[i]) + (1 - yv[i]) * log_sigmoid(-xs[i]));
    }
    const Tensor none = binary_cross_entropy_with_logits(x, y, Reduction::none, weighted ? pw : Tensor());
    const std::vector<double> got = host_f64(none);
    for (size_t i = 0; i < xs.size(); ++i)
      EXPECT_NEAR(got[i], expected[i], 1e-12 * (1 + std::fabs(expected[i]))) << "logit " << xs[i];
    EXPECT_NEAR(binary_cross_entropy_with_logits(x, y, Reduction::sum, weighted ? pw : Tensor()).item(), total,
                1e-12 * total);
    EXPECT_NEAR(binary_cross_entropy_with_logits(x, y, Reduction::mean, weighted ? pw : Tensor()).item(),
                total / static_cast<double>(n), 1e-12 * total);
  }
  for (DType dt : {DType::f16, DType::bf16}) {
    const Tensor x16 = prim::to(randn({8, 4}, DType::f32, kCPU, &gen), dt);
    const Tensor y16 = prim::to(rand({8, 4}, DType::f32, kCPU, &gen, 0, 1), dt);
    const Tensor loss = binary_cross_entropy_with_logits(x16, y16);
    EXPECT_EQ(loss.dtype(), DType::f32) << dtype_name(dt);
    EXPECT_EQ(loss.item(), binary_cross_entropy_with_logits(prim::to(x16, DType::f32), prim::to(y16, DType::f32)).item());
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

// A masked class (logit -inf) takes no probability and leaves the loss
// and the gradient finite, as in PyTorch; a target that is itself masked
// costs an infinite loss.
TEST(AutogradForward, CrossEntropyOfMaskedClassesIsFinite) {
  const double inf = std::numeric_limits<double>::infinity();
  for (DType dt : {DType::f32, DType::f64, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor logits = to(from_vector({1.f, -INFINITY, 3.f, -INFINITY, 0.f, 0.f}, {2, 3}), dt).set_requires_grad(true);
    const Tensor target = from_vector(std::vector<int64_t>{2, 1}, {2}, DType::i64);
    const double l0 = -std::log(std::exp(3.0) / (std::exp(1.0) + std::exp(3.0)));
    const double l1 = std::log(2.0);
    const Tensor loss = cross_entropy(logits, target);
    EXPECT_NEAR(loss.item(), (l0 + l1) / 2, 1e-6);
    backward(loss);
    const std::vector<double> g = to(logits.grad(), DType::f64).to_vector<double>();
    for (double x : g) EXPECT_TRUE(std::isfinite(x));
    EXPECT_EQ(g[1], 0.0);
    EXPECT_EQ(g[3], 0.0);
    EXPECT_EQ(cross_entropy(logits, from_vector(std::vector<int64_t>{1, 1}, {2}, DType::i64)).item(), inf);
  }
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

// A rule (here a hand-written one) that returns a gradient of the wrong
// shape is named in the error, not only the two shapes.
TEST(Engine, ARuleThatReturnsAWrongShapeIsNamed) {
  const Tensor x = ones({3}).set_requires_grad(true);
  auto wrong = [&] {
    Tensor y = prim::mul_scalar(x, 2.0);
    record("wrong_rule", y, {x}, [](const Grads&) { return Grads{ones({2})}; });
    return y;
  };
  const std::string alone = testing::error_of<ShapeError>([&] { backward(sum(wrong())); });
  EXPECT_NE(alone.find("gradient f32[2] on cpu does not match its leaf f32[3]"), std::string::npos) << alone;
  // Made after it, mul's rule runs first: the wrong gradient is the second to arrive.
  const Tensor from_wrong = wrong(), from_mul = mul(x, x);
  const std::string summed = testing::error_of<ShapeError>([&] { backward(sum(add(from_wrong, from_mul))); });
  EXPECT_NE(summed.find("the rule of 'wrong_rule' (for its input 0) made the gradient f32[2]"), std::string::npos)
      << summed;
}

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
  testing::expect_contains(testing::error_of<ValueError>([&] { backward(sum(a * a)); }),
                           {"backward: the tensor", "does not require grad and has no grad_fn"});
  EXPECT_THROW(backward(b * 2.0), ShapeError);  // non-scalar root without a gradient
  EXPECT_THROW(ones({2}, DType::i64).set_requires_grad(true), DTypeError);
}

TEST(Engine, BackwardWithAGivenGradient) {
  Tensor x = from_vector({1.f, 2.f, 3.f}, {3});
  x.set_requires_grad(true);
  backward(x * 2.0, from_vector({1.f, 10.f, 100.f}, {3}));
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{2, 20, 200}));
}

// backward over several roots at once: two roots built on one shared
// subgraph, and a root that lies inside the other root's graph (its node
// must wait for the gradient flowing down from the other root as well as its
// own seed). Either way the gradients are the sum of one pass per root, and
// the analytic ones: with h = tanh(x w), r1 = sum(h^2) and r2 = 3h + exp(x)
// (or h itself), seeded with g2.
TEST(Engine, SeveralRootsInOnePassSumTheirGradients) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  const Tensor x0 = randn({5}, DType::f64, kCPU, &gen), w0 = randn({5}, DType::f64, kCPU, &gen),
               g2 = randn({5}, DType::f64, kCPU, &gen);
  for (bool nested : {false, true}) {
    SCOPED_TRACE(nested ? "the second root inside the first's graph" : "two roots on a shared subgraph");
    Tensor x = prim::clone(x0), w = prim::clone(w0);
    x.set_requires_grad(true);
    w.set_requires_grad(true);
    auto roots = [&] {
      const Tensor h = tanh(x * w);
      return std::make_pair(sum(h * h), nested ? h : h * 3.0 + exp(x));
    };
    const auto [a1, a2] = roots();
    backward(a1);
    const auto [b1, b2] = roots();
    backward(b2, g2);
    const std::vector<double> gx_apart = host_f64(x.grad()), gw_apart = host_f64(w.grad());

    x.set_grad(Tensor());
    w.set_grad(Tensor());
    const auto [r1, r2] = roots();
    backward(std::vector<Tensor>{r1, r2}, std::vector<Tensor>{Tensor(), g2});
    const std::vector<double> gx = host_f64(x.grad()), gw = host_f64(w.grad());
    EXPECT_LE(rel_error(gx, gx_apart), 1e-12) << "gradient of x";
    EXPECT_LE(rel_error(gw, gw_apart), 1e-12) << "gradient of w";

    const std::vector<double> xv = host_f64(x0), wv = host_f64(w0), gv = host_f64(g2);
    std::vector<double> gx_want(xv.size()), gw_want(xv.size());
    for (size_t i = 0; i < xv.size(); ++i) {
      const double h = std::tanh(xv[i] * wv[i]), dh = 1 - h * h;  // dh/d(xw)
      const double dr2_dh = nested ? gv[i] : 3 * gv[i];
      gx_want[i] = (2 * h + dr2_dh) * dh * wv[i] + (nested ? 0.0 : gv[i] * std::exp(xv[i]));
      gw_want[i] = (2 * h + dr2_dh) * dh * xv[i];
    }
    EXPECT_LE(rel_error(gx, gx_want), 1e-12) << "gradient of x";
    EXPECT_LE(rel_error(gw, gw_want), 1e-12) << "gradient of w";
  }
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
