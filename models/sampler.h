#pragma once
// Samplers decide which sample indices an epoch visits, in which order.
// Orders are pure functions of (seed, epoch): a resumed run, or a run with
// another number of loader workers, sees exactly the same sequence.
#include <cstdint>
#include <vector>

namespace mpt::data {

// A permutation of 0..n-1 drawn from the seed alone (Fisher-Yates over a
// 64-bit Mersenne Twister, whose output sequence is fixed by the C++
// standard, so orders are the same on every platform).
std::vector<int64_t> seeded_permutation(int64_t n, uint64_t seed);

class Sampler {
 public:
  virtual ~Sampler() = default;
  // The indices of epoch `epoch`, in visiting order.
  virtual std::vector<int64_t> indices(int64_t epoch) const = 0;
};

// Every sample once per epoch: in order, or shuffled with seed + epoch.
class SequentialOrRandomSampler : public Sampler {
 public:
  SequentialOrRandomSampler(int64_t size, bool shuffle, uint64_t seed = 0);
  std::vector<int64_t> indices(int64_t epoch) const override;

 private:
  int64_t size_;
  bool shuffle_;
  uint64_t seed_;
};

// One rank's shard, PyTorch's DistributedSampler rule: the epoch's order
// (shuffled with seed + epoch, the same on every rank) is padded by
// repeating its beginning up to a multiple of world_size (or cut down to
// one when drop_last), and rank r takes positions r, r + world, r + 2 world, ...
// Every rank gets the same count, so collective steps stay in lock-step.
class DistributedSampler : public Sampler {
 public:
  DistributedSampler(int64_t size, int world_size, int rank, bool shuffle = true, uint64_t seed = 0,
                     bool drop_last = false);
  std::vector<int64_t> indices(int64_t epoch) const override;
  int64_t num_samples() const { return num_samples_; }  // per rank

 private:
  int64_t size_;
  int world_size_, rank_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  int64_t num_samples_;
};

}  // namespace mpt::data
