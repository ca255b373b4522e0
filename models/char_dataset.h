#pragma once
// Character-level language modelling from any text file: the vocabulary is
// the file's distinct bytes (sorted), and sample i is the window of
// `context` tokens starting at byte i with, as targets, the same window
// shifted by one.
#include <memory>
#include <string>
#include <utility>

#include "models/dataset.h"

namespace mpt::data {

// A small default corpus installed by scripts/setup.sh (package fortunes-min).
inline constexpr const char* kDefaultTextCorpus = "/usr/share/games/fortunes/fortunes";

class CharDataset : public Dataset {
 public:
  CharDataset(const std::string& path, int64_t context);
  // Text already in memory (name is used in messages).
  CharDataset(std::string text, int64_t context, const std::string& name);

  int64_t size() const override { return count_; }
  // input, target: i64 [N, context].
  Batch get_batch(const std::vector<int64_t>& indices) const override;

  int64_t vocab_size() const { return static_cast<int64_t>(vocab_.size()); }
  int64_t context() const { return context_; }
  const std::string& vocabulary() const { return vocab_; }  // token id -> byte
  std::string decode(const std::vector<int64_t>& tokens) const;
  // The token ids of `text`; ValueError naming the first byte the
  // vocabulary lacks.
  std::vector<int64_t> encode(const std::string& text) const;

  // The windows starting in [first, first + count), same vocabulary and
  // text (shared, not copied): e.g. a held-out tail for validation.
  CharDataset subset(int64_t first, int64_t count) const;
  // The last `held_out` windows, and for training the windows before them
  // that read none of their bytes (a window reads context + 1 of them: one
  // trained on the held-out text would flatter its evaluation). ValueError
  // when no training window is left.
  std::pair<CharDataset, CharDataset> split_held_out(int64_t held_out) const;

 private:
  int64_t context_;
  std::string vocab_;
  std::shared_ptr<const std::vector<uint8_t>> tokens_;  // each byte of the text as its token id
  int64_t first_ = 0, count_ = 0;                      // the windows this set serves
};

}  // namespace mpt::data
