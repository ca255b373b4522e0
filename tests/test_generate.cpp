// Sampling text from a GPT: draws follow the softmax of the logits over the
// temperature (cut to the k likeliest), greedy picks the likeliest, and a
// model that learned a pattern continues it past its context window.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "models/adamw.h"
#include "models/generate.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

using nn::SamplingOptions;
using testing::error_of;
using testing::expect_contains;

class Sampling : public ::testing::Test {
 protected:
  void SetUp() override { gen_.manual_seed(seed_); }
  std::string trace() const { return fmt::format("seed {}", seed_); }
  uint64_t seed_ = testing::fresh_seed();
  Generator gen_;
};

TEST_F(Sampling, GreedyTakesTheLikeliestTokenAndTheLowerIdOnATie) {
  const std::vector<double> logits = {1, 3, 3, -INFINITY, 2};
  const uint64_t offset = gen_.offset();
  EXPECT_EQ(nn::sample_token(logits, {.temperature = 0}, gen_), 1);
  EXPECT_EQ(nn::sample_token(logits, {.temperature = 5, .top_k = 1}, gen_), 1);
  EXPECT_EQ(gen_.offset(), offset) << "a greedy pick drew a random number";
  EXPECT_EQ(nn::sample_token({-INFINITY, 0.5}, {.temperature = 0}, gen_), 1);
}

// Frequencies over many draws against softmax(logits / T) restricted to the
// top k, within 5 standard deviations of a binomial count (plus 1e-4).
TEST_F(Sampling, DrawsInProportionToTheSoftmaxOfTheKept) {
  SCOPED_TRACE(trace());
  std::mt19937_64 rng(seed_);
  std::normal_distribution<double> normal(0, 2);
  std::vector<double> logits(8);
  for (double& l : logits) l = normal(rng);
  logits[5] = -INFINITY;  // never drawn
  for (const SamplingOptions o : {SamplingOptions{1, 0}, SamplingOptions{0.5, 0}, SamplingOptions{2, 3}}) {
    SCOPED_TRACE(fmt::format("temperature {} top_k {}", o.temperature, o.top_k));
    std::vector<int64_t> order(logits.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return logits[a] > logits[b]; });
    const size_t keep = o.top_k == 0 ? logits.size() : static_cast<size_t>(o.top_k);
    std::vector<double> p(logits.size(), 0.0);
    double total = 0;
    for (size_t i = 0; i < keep; ++i) total += p[order[i]] = std::exp(logits[order[i]] / o.temperature);
    for (double& x : p) x /= total;
    constexpr int kDraws = 40000;
    std::vector<int> count(logits.size(), 0);
    for (int i = 0; i < kDraws; ++i) ++count.at(static_cast<size_t>(nn::sample_token(logits, o, gen_)));
    for (size_t t = 0; t < logits.size(); ++t) {
      const double f = static_cast<double>(count[t]) / kDraws;
      EXPECT_NEAR(f, p[t], 5 * std::sqrt(p[t] * (1 - p[t]) / kDraws) + 1e-4) << "token " << t;
      if (p[t] == 0) EXPECT_EQ(count[t], 0) << "token " << t << " is outside the kept set";
    }
  }
}

TEST_F(Sampling, RefusesWhatCannotBeSampled) {
  expect_contains(error_of<ValueError>([&] { nn::sample_token({}, {}, gen_); }), {"sample_token", "no logits"});
  expect_contains(error_of<ValueError>([&] { nn::sample_token({0, NAN}, {}, gen_); }), {"logit 1", "nan"});
  expect_contains(error_of<ValueError>([&] { nn::sample_token({INFINITY, 0}, {}, gen_); }), {"logit 0", "inf"});
  expect_contains(error_of<ValueError>([&] { nn::sample_token({-INFINITY, -INFINITY}, {}, gen_); }),
                  {"every one of the 2 logits is -inf"});
  expect_contains(error_of<ValueError>([&] { nn::sample_token({0}, {.temperature = -1}, gen_); }),
                  {"temperature", "-1"});
  expect_contains(error_of<ValueError>([&] { nn::sample_token({0}, {.temperature = NAN}, gen_); }),
                  {"temperature", "nan"});
  expect_contains(error_of<ValueError>([&] { nn::sample_token({0}, {.top_k = -2}, gen_); }), {"top_k", "-2"});
}

// A GPT of 5 tokens that learned the cycle 0 1 2 3 4 0 1 ... from windows
// of 8 tokens.
std::shared_ptr<nn::GPT> gpt_that_learned_a_cycle(uint64_t seed, double* last_loss) {
  constexpr int64_t kVocab = 5, kContext = 8, kBatch = 16;
  Generator gen(seed);
  auto model = std::make_shared<nn::GPT>(
      nn::GPTOptions{.vocab_size = kVocab, .context = kContext, .d_model = 32, .n_layers = 1, .n_heads = 2}, &gen);
  optim::AdamW adamw(model->parameters(), {.lr = 1e-2, .weight_decay = 0});
  std::mt19937_64 rng(seed);
  for (int step = 0; step < 200; ++step) {
    std::vector<int64_t> x, y;
    for (int64_t b = 0; b < kBatch; ++b) {
      const int64_t start = static_cast<int64_t>(rng() % kVocab);
      for (int64_t t = 0; t < kContext; ++t) {
        x.push_back((start + t) % kVocab);
        y.push_back((start + t + 1) % kVocab);
      }
    }
    adamw.zero_grad();
    const Tensor logits = model->forward(from_vector(x, {kBatch, kContext}, DType::i64));
    const Tensor loss = cross_entropy(reshape(logits, {-1, kVocab}), from_vector(y, {kBatch * kContext}, DType::i64));
    backward(loss);
    adamw.step();
    *last_loss = loss.item();
  }
  return model;
}

TEST_F(Sampling, AGptContinuesTheCycleItLearnedPastItsContext) {
  SCOPED_TRACE(trace());
  double loss = 0;
  const auto model = gpt_that_learned_a_cycle(seed_, &loss);
  ASSERT_LT(loss, 0.01) << "the model did not learn the cycle";
  const std::vector<int64_t> prompt = {2, 3};
  // Drawn at temperature 0.5, a wrong token has a probability of about the
  // square of the loss's: 20 draws go wrong with a chance near 1e-3.
  for (const SamplingOptions o : {SamplingOptions{0, 0}, SamplingOptions{0.5, 0}, SamplingOptions{0.5, 2}}) {
    SCOPED_TRACE(fmt::format("temperature {} top_k {}", o.temperature, o.top_k));
    const std::vector<int64_t> tokens = nn::generate(*model, prompt, 20, o, gen_);  // 22 tokens, context 8
    ASSERT_EQ(tokens.size(), 22u);
    for (size_t i = 0; i < tokens.size(); ++i) EXPECT_EQ(tokens[i], static_cast<int64_t>(2 + i) % 5) << "token " << i;
  }
  EXPECT_TRUE(model->is_training()) << "generate left the model in eval mode";
  EXPECT_TRUE(grad_enabled());
  // A block in eval mode inside a training model stays so.
  (*model->blocks)[0]->eval();
  nn::generate(*model, prompt, 2, SamplingOptions{0, 0}, gen_);
  EXPECT_FALSE((*model->blocks)[0]->is_training()) << "generate put the block back in training mode";
  EXPECT_TRUE(model->is_training() && model->tok->is_training());
}

// The draws come from the generator alone: the same seed gives the same
// text, another seed other text (an untrained model's distribution is
// nearly flat, so 40 draws from 5 tokens would agree by chance with
// probability below 1e-20).
TEST_F(Sampling, TheSameSeedGivesTheSameText) {
  SCOPED_TRACE(trace());
  Generator init(seed_);
  nn::GPT model({.vocab_size = 5, .context = 8, .d_model = 16, .n_layers = 1, .n_heads = 2}, &init);
  auto text = [&](uint64_t seed) {
    Generator gen(seed);
    return nn::generate(model, {0}, 40, {}, gen);
  };
  EXPECT_EQ(text(seed_), text(seed_));
  EXPECT_NE(text(seed_), text(seed_ + 1));
}

// Reading a sequence a few tokens at a time on top of the cached keys and
// values gives each last position the logits that reading the whole
// sequence gives it, for a batch of two, from a first read of three tokens
// on to the end of the context, which it refuses to pass.
TEST_F(Sampling, CachedReadsGiveTheLogitsOfWholeReads) {
  SCOPED_TRACE(trace());
  constexpr int64_t kVocab = 7, kContext = 9;
  nn::GPT model({.vocab_size = kVocab, .context = kContext, .d_model = 24, .n_layers = 2, .n_heads = 3}, &gen_);
  std::mt19937_64 rng(seed_);
  std::vector<std::vector<int64_t>> rows(2);
  for (auto& row : rows)
    for (int64_t t = 0; t < kContext; ++t) row.push_back(static_cast<int64_t>(rng() % kVocab));
  auto columns = [&](int64_t from, int64_t to) {
    std::vector<int64_t> v;
    for (const auto& row : rows) v.insert(v.end(), row.begin() + from, row.begin() + to);
    return from_vector(v, {2, to - from}, DType::i64);
  };
  nn::GPTCache cache;
  for (const auto& [from, to] : std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {3, 4}, {4, 6}, {6, 9}}) {
    SCOPED_TRACE(fmt::format("positions {} to {}", from, to - 1));
    const Tensor cached = model.forward_cached(columns(from, to), cache);
    ASSERT_EQ(cached.shape(), (Shape{2, kVocab}));
    EXPECT_EQ(cache.length, to);
    Tensor whole;
    {
      NoGradGuard no_grad;
      whole = prim::slice(model.forward(columns(0, to)), 1, to - 1, to);
    }
    EXPECT_LE(testing::rel_error(testing::host_f64(cached), testing::host_f64(whole)), 1e-5);
    EXPECT_FALSE(cached.requires_grad());
  }
  expect_contains(error_of<ShapeError>([&] { model.forward_cached(columns(0, 1), cache); }),
                  {"GPT::forward_cached", "9 positions read and 1 more exceed the context of 9"});
  cache.length = 0;
  expect_contains(error_of<ShapeError>([&] { model.forward_cached(from_vector(std::vector<int64_t>{1}, {1, 1}, DType::i64), cache); }),
                  {"GPT::forward_cached", "another model's or batch's", "keys [1, 3, 9, 8]"});
  nn::GPT wider({.vocab_size = kVocab, .context = kContext, .d_model = 36, .n_layers = 2, .n_heads = 3}, &gen_);
  expect_contains(error_of<ShapeError>([&] { wider.forward_cached(columns(0, 1), cache); }),
                  {"another model's or batch's", "keys f32[2, 3, 9, 8]", "keys [2, 3, 9, 12]"});
}

TEST_F(Sampling, GenerateRefusesABadPromptOrCount) {
  nn::GPT model({.vocab_size = 5, .context = 8, .d_model = 16, .n_layers = 1, .n_heads = 2}, &gen_);
  expect_contains(error_of<ValueError>([&] { nn::generate(model, {}, 3, {}, gen_); }), {"generate", "prompt"});
  expect_contains(error_of<ValueError>([&] { nn::generate(model, {1, 5}, 3, {}, gen_); }),
                  {"generate", "prompt token 1 is 5", "[0, 5)"});
  expect_contains(error_of<ValueError>([&] { nn::generate(model, {1}, -1, {}, gen_); }), {"generate", "-1"});
  expect_contains(error_of<ValueError>([&] { nn::generate(model, {1}, 3, {.temperature = -1}, gen_); }),
                  {"temperature"});
  EXPECT_EQ(nn::generate(model, {1, 2}, 0, {}, gen_), (std::vector<int64_t>{1, 2}));
}

}  // namespace
}  // namespace mpt
