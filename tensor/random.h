#pragma once
// The seeded, counter-based random source. A Generator is (seed, offset):
// each draw of n numbers takes ceil(n / 4) Philox blocks starting at offset
// and moves offset past them. No hidden state: saving the pair restores the
// stream exactly, on any device.
#include <cstdint>

namespace mpt {

class Generator {
 public:
  explicit Generator(uint64_t seed = 0) : seed_(seed) {}
  void manual_seed(uint64_t seed) {
    seed_ = seed;
    offset_ = 0;
  }
  uint64_t seed() const { return seed_; }
  uint64_t offset() const { return offset_; }
  void set_state(uint64_t seed, uint64_t offset) {
    seed_ = seed;
    offset_ = offset;
  }
  // Reserves blocks for n numbers; returns the first block's offset.
  uint64_t take(int64_t n) {
    const uint64_t start = offset_;
    offset_ += static_cast<uint64_t>((n + 3) / 4);
    return start;
  }
  // A generator of its own for one of several parallel users (a device's
  // thread, say): seeded from this one's seed and position, which moves on
  // by one block, so each fork draws other numbers and manual_seed() on
  // this generator still decides them all.
  Generator fork();

 private:
  uint64_t seed_;
  uint64_t offset_ = 0;
};

// This thread's default generator (seeded with 0 until manual_seed).
Generator& default_generator();
void manual_seed(uint64_t seed);

}  // namespace mpt
