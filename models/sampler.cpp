#include "models/sampler.h"

#include <numeric>
#include <random>

#include "tensor/error.h"

namespace mpt::data {

std::vector<int64_t> seeded_permutation(int64_t n, uint64_t seed) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::mt19937_64 rng(seed);
  // Not std::shuffle / uniform_int_distribution: their draws differ between
  // standard libraries. The modulo bias (below 2^-40 for any real n) is harmless.
  for (int64_t i = n - 1; i > 0; --i) {
    const int64_t j = static_cast<int64_t>(rng() % static_cast<uint64_t>(i + 1));
    std::swap(order[i], order[j]);
  }
  return order;
}

SequentialOrRandomSampler::SequentialOrRandomSampler(int64_t size, bool shuffle, uint64_t seed)
    : size_(size), shuffle_(shuffle), seed_(seed) {
  check(size >= 0, "SequentialOrRandomSampler: size {} must not be negative", size);
}

std::vector<int64_t> SequentialOrRandomSampler::indices(int64_t epoch) const {
  check(epoch >= 0, "SequentialOrRandomSampler: epoch {} must not be negative", epoch);
  if (shuffle_) return seeded_permutation(size_, seed_ + static_cast<uint64_t>(epoch));
  std::vector<int64_t> order(static_cast<size_t>(size_));
  std::iota(order.begin(), order.end(), int64_t{0});
  return order;
}

DistributedSampler::DistributedSampler(int64_t size, int world_size, int rank, bool shuffle, uint64_t seed,
                                       bool drop_last)
    : size_(size), world_size_(world_size), rank_(rank), shuffle_(shuffle), seed_(seed), drop_last_(drop_last) {
  check(world_size >= 1, "DistributedSampler: world_size {} must be at least 1", world_size);
  check(rank >= 0 && rank < world_size, "DistributedSampler: rank {} out of range [0, {})", rank, world_size);
  check(size >= 1, "DistributedSampler: data set size {} must be positive", size);
  num_samples_ = drop_last ? size / world_size : (size + world_size - 1) / world_size;
  check(num_samples_ >= 1, "DistributedSampler: {} samples cannot give each of {} ranks one with drop_last", size,
        world_size);
}

std::vector<int64_t> DistributedSampler::indices(int64_t epoch) const {
  check(epoch >= 0, "DistributedSampler: epoch {} must not be negative", epoch);
  std::vector<int64_t> order = SequentialOrRandomSampler(size_, shuffle_, seed_).indices(epoch);
  const int64_t total = num_samples_ * world_size_;
  if (total <= size_) {
    order.resize(static_cast<size_t>(total));
  } else {
    // Pad by repeating the order from its start (as often as needed).
    for (int64_t i = 0; static_cast<int64_t>(order.size()) < total; ++i) order.push_back(order[i % size_]);
  }
  std::vector<int64_t> shard;
  shard.reserve(static_cast<size_t>(num_samples_));
  for (int64_t i = rank_; i < total; i += world_size_) shard.push_back(order[i]);
  return shard;
}

}  // namespace mpt::data
