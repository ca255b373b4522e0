#include "tensor/random.h"

namespace mpt {

Generator& default_generator() {
  thread_local Generator gen(0);
  return gen;
}

void manual_seed(uint64_t seed) { default_generator().manual_seed(seed); }

namespace {

// SplitMix64's finalizer: nearby inputs give unrelated outputs.
uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

Generator Generator::fork() {
  const uint64_t at = take(4);
  return Generator(mix(seed_ ^ mix(at)));
}

}  // namespace mpt
