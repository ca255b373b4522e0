#include "models/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "models/training_mode.h"
#include "tensor/philox.h"

namespace mpt::nn {
namespace {

// [0, 1) with 53 random bits (two words of one Philox block): a token of
// probability p is drawn with probability p to double precision, however
// small p is.
double uniform53(Generator& gen) {
  const Philox4 r = philox4x32_10(gen.take(4), gen.seed());
  const uint64_t bits = (uint64_t{r.v[0]} >> 5) << 26 | (uint64_t{r.v[1]} >> 6);
  return static_cast<double>(bits) * 0x1p-53;
}

}  // namespace

void check_sampling_options(const SamplingOptions& options) {
  check(std::isfinite(options.temperature) && options.temperature >= 0,
        "sampling: temperature must be finite and not negative (0: greedy), got {}", options.temperature);
  check(options.top_k >= 0, "sampling: top_k must not be negative (0: every token), got {}", options.top_k);
}

int64_t sample_token(const std::vector<double>& logits, const SamplingOptions& options, Generator& gen) {
  check_sampling_options(options);
  check(!logits.empty(), "sample_token: no logits");
  for (size_t i = 0; i < logits.size(); ++i)
    check(!std::isnan(logits[i]) && logits[i] != INFINITY, "sample_token: logit {} is {}", i, logits[i]);
  // Token ids from the likeliest down; equal logits keep id order.
  std::vector<int64_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  const auto n = static_cast<int64_t>(logits.size());
  const int64_t keep = options.top_k == 0 ? n : std::min(options.top_k, n);
  std::partial_sort(order.begin(), order.begin() + keep, order.end(), [&](int64_t a, int64_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  const double best = logits[order[0]];
  check(best != -INFINITY, "sample_token: every one of the {} logits is -inf", n);
  if (options.temperature == 0 || keep == 1) return order[0];
  // Weights relative to the likeliest token's (1), so that none overflows.
  std::vector<double> cumulative(static_cast<size_t>(keep));
  double total = 0;
  for (int64_t i = 0; i < keep; ++i) {
    total += std::exp((logits[order[i]] - best) / options.temperature);
    cumulative[i] = total;
  }
  const double u = uniform53(gen) * total;
  const auto at = std::upper_bound(cumulative.begin(), cumulative.end(), u) - cumulative.begin();
  return order[std::min<int64_t>(at, keep - 1)];
}

std::vector<int64_t> generate(GPT& model, const std::vector<int64_t>& prompt, int64_t new_tokens,
                              const SamplingOptions& options, Generator& gen) {
  check_sampling_options(options);
  check(!prompt.empty(), "generate: the prompt must hold at least one token");
  check(new_tokens >= 0, "generate: the number of new tokens must not be negative, got {}", new_tokens);
  const int64_t vocab = model.options.vocab_size, context = model.options.context;
  for (size_t i = 0; i < prompt.size(); ++i)
    check(prompt[i] >= 0 && prompt[i] < vocab, "generate: prompt token {} is {}, outside the vocabulary [0, {})", i,
          prompt[i], vocab);
  const Device device = model.tok->weight.device();
  NoGradGuard no_grad;
  EvalModeGuard eval_mode(model);
  std::vector<int64_t> tokens = prompt;
  tokens.reserve(prompt.size() + static_cast<size_t>(new_tokens));
  // Each new token is read on top of the cached keys and values; once the
  // context is full the window slides, every position moves, and the last
  // `context` tokens are read again whole.
  GPTCache cache;
  auto read_window = [&] {
    const int64_t t = std::min<int64_t>(static_cast<int64_t>(tokens.size()), context);
    cache.length = 0;
    return model.forward_cached(from_vector(std::vector<int64_t>(tokens.end() - t, tokens.end()), {1, t}, DType::i64,
                                            device),
                                cache);
  };
  Tensor logits;  // [1, vocab] for the position after the last token
  for (int64_t i = 0; i < new_tokens; ++i) {
    if (i == 0 || cache.length == context)
      logits = read_window();
    else
      logits = model.forward_cached(from_vector(std::vector<int64_t>{tokens.back()}, {1, 1}, DType::i64, device), cache);
    // Only that row comes to the host.
    tokens.push_back(sample_token(prim::to(prim::to(logits, DType::f64), kCPU).to_vector<double>(), options, gen));
  }
  return tokens;
}

}  // namespace mpt::nn
