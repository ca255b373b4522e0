#include "tools/mpt-train/text_sample.h"

namespace mpt::tools {

TextSampler::TextSampler(const train::Workload& w, const TrainConfig& c)
    : text_(w.text), tokens_(c.sample_tokens), options_{c.sample_temperature, c.sample_top_k} {
  auto* gpt = dynamic_cast<nn::GPT*>(w.model.get());
  if (!gpt || !text_ || tokens_ == 0) return;  // (the options were checked with mpt-train's others)
  if (c.sample_prompt.empty()) {
    prompt_ = {text_->get_batch({0}).input.to_vector<int64_t>().front()};
  } else {
    try {
      prompt_ = text_->encode(c.sample_prompt);
    } catch (const ValueError& e) {
      throw ValueError(fmt::format("mpt-train: --sample-prompt: {}", e.what()));
    }
  }
  // Flipped bits keep the stream apart from the weights' and the data
  // order's, which start from the seed itself.
  seed_ = c.seed ^ 0x5eed5a3b1e5eed5aULL;
  model_ = gpt;
}

void TextSampler::sample(int64_t step, Progress& progress) const {
  if (!enabled()) return;
  Generator gen;
  gen.set_state(seed_, static_cast<uint64_t>(step) << 24);  // 2^24 blocks a sample: 16M tokens apart
  const std::vector<int64_t> tokens = nn::generate(*model_, prompt_, tokens_, options_, gen);
  const std::string prompt = text_->decode(prompt_);
  const std::string text =
      text_->decode(std::vector<int64_t>(tokens.begin() + static_cast<std::ptrdiff_t>(prompt_.size()), tokens.end()));
  progress.message(fmt::format("mpt-train: sample after step {} (temperature {:g}{}):\n{}{}", step,
                               options_.temperature,
                               options_.top_k > 0 ? fmt::format(", top {}", options_.top_k) : "", prompt, text));
  // Bytes that are not UTF-8 are replaced in the metrics only.
  progress.record({{"event", "sample"}, {"step", step}, {"temperature", options_.temperature},
                   {"top_k", options_.top_k}, {"prompt", as_utf8(prompt)}, {"text", as_utf8(text)}});
}

}  // namespace mpt::tools
