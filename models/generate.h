#pragma once
// Text from a trained GPT: each new token is drawn from the model's
// distribution for the position after the last one (the softmax of its
// logits over a temperature, optionally cut to the k likeliest tokens) and
// fed back in, as nanoGPT's and llm.c's samplers do.
#include <cstdint>
#include <vector>

#include "models/gpt.h"
#include "tensor/random.h"

namespace mpt::nn {

struct SamplingOptions {
  double temperature = 1.0;  // 0: always the likeliest token (greedy)
  int64_t top_k = 0;         // draw among the k likeliest tokens only; 0: among all
};

// ValueError for a negative or non-finite temperature, or a negative top_k.
void check_sampling_options(const SamplingOptions& options);

// A token id drawn from one row of logits as `options` say, with one
// uniform number from `gen` (none when greedy). Ties go to the lower id.
// ValueError for an empty row or a NaN or +inf logit.
int64_t sample_token(const std::vector<double>& logits, const SamplingOptions& options, Generator& gen);

// `prompt` followed by `new_tokens` sampled tokens, each drawn from the
// model's logits after the last `context` tokens. The model reads each new
// token on top of the keys and values it cached (GPT::forward_cached);
// once the context is full the window slides and is read again whole for
// each token. It runs on the device its parameters are on, under the
// caller's autocast, without recording gradients, in eval mode (its mode
// is put back after). ValueError for an empty prompt, a token outside the
// vocabulary or a negative count.
std::vector<int64_t> generate(GPT& model, const std::vector<int64_t>& prompt, int64_t new_tokens,
                              const SamplingOptions& options, Generator& gen);

}  // namespace mpt::nn
