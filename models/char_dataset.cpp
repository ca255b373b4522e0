#include "models/char_dataset.h"

#include <array>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

#include "tensor/error.h"

namespace mpt::data {
namespace {

std::string read_text(const std::string& path) {
  // A folder opens like a file here, then reads as nothing.
  check<IOError>(!std::filesystem::is_directory(path), "CharDataset: '{}' is a folder, not a text file", path);
  std::ifstream in(path, std::ios::binary);
  check<IOError>(in.good(), "CharDataset: cannot open '{}'", path);
  // Read by size and counted: `s << in.rdbuf()` reports no read error, so a
  // failing disk would give a shorter corpus (and another vocabulary).
  std::error_code ec;
  const uintmax_t size = std::filesystem::file_size(path, ec);
  check<IOError>(!ec, "CharDataset: cannot find the size of '{}': {}", path, ec.message());
  std::string text(size, '\0');
  in.read(text.data(), static_cast<std::streamsize>(size));
  check<IOError>(static_cast<uintmax_t>(in.gcount()) == size, "CharDataset: reading '{}' failed after {} of {} bytes",
                 path, in.gcount(), size);
  return text;
}

}  // namespace

CharDataset::CharDataset(const std::string& path, int64_t context) : CharDataset(read_text(path), context, path) {}

CharDataset::CharDataset(std::string text, int64_t context, const std::string& name) : context_(context) {
  check(context > 0, "CharDataset: context {} must be positive", context);
  check<IOError>(static_cast<int64_t>(text.size()) > context,
                 "CharDataset: '{}' has {} bytes; need more than the context of {}", name, text.size(), context);
  std::array<bool, 256> seen{};
  for (unsigned char c : text) seen[c] = true;
  std::array<uint8_t, 256> id{};
  for (int c = 0; c < 256; ++c)
    if (seen[c]) {
      id[c] = static_cast<uint8_t>(vocab_.size());
      vocab_.push_back(static_cast<char>(c));
    }
  auto tokens = std::make_shared<std::vector<uint8_t>>();
  tokens->reserve(text.size());
  for (unsigned char c : text) tokens->push_back(id[c]);
  tokens_ = std::move(tokens);
  count_ = static_cast<int64_t>(tokens_->size()) - context;
}

Batch CharDataset::get_batch(const std::vector<int64_t>& indices) const {
  const int64_t n = static_cast<int64_t>(indices.size());
  Tensor input = Tensor::empty({n, context_}, DType::i64), target = Tensor::empty({n, context_}, DType::i64);
  int64_t* x = input.data<int64_t>();
  int64_t* y = target.data<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = indices[i];
    check(s >= 0 && s < size(), "CharDataset::get_batch: index {} out of range [0, {})", s, size());
    for (int64_t t = 0; t < context_; ++t) {
      x[i * context_ + t] = (*tokens_)[first_ + s + t];
      y[i * context_ + t] = (*tokens_)[first_ + s + t + 1];
    }
  }
  return {input, target};
}

CharDataset CharDataset::subset(int64_t first, int64_t count) const {
  check(first >= 0 && first <= count_ && count >= 1 && count <= count_ - first,
        "CharDataset::subset: {} windows from {} do not fit in [0, {})", count, first, count_);
  CharDataset out = *this;
  out.first_ = first_ + first;
  out.count_ = count;
  return out;
}

std::pair<CharDataset, CharDataset> CharDataset::split_held_out(int64_t held_out) const {
  const int64_t trained = count_ - held_out - context_;
  check(held_out >= 1 && trained >= 1,
        "CharDataset::split_held_out: {} windows of context {} leave no training window before {} held-out ones",
        count_, context_, held_out);
  return {subset(0, trained), subset(count_ - held_out, held_out)};
}

std::string CharDataset::decode(const std::vector<int64_t>& tokens) const {
  std::string out;
  for (int64_t t : tokens) {
    check(t >= 0 && t < vocab_size(), "CharDataset::decode: token {} out of range [0, {})", t, vocab_size());
    out.push_back(vocab_[t]);
  }
  return out;
}

std::vector<int64_t> CharDataset::encode(const std::string& text) const {
  std::vector<int64_t> tokens;
  tokens.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const size_t id = vocab_.find(text[i]);  // the vocabulary is at most 256 sorted bytes
    check(id != std::string::npos, "CharDataset::encode: byte {} of '{}' (0x{:02x}) is not in the vocabulary", i, text,
          static_cast<unsigned char>(text[i]));
    tokens.push_back(static_cast<int64_t>(id));
  }
  return tokens;
}

}  // namespace mpt::data
