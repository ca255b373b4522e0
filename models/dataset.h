#pragma once
// A data set is a fixed-size collection of samples that hands out batches
// by index. get_batch() must be safe to call from several threads at once
// (the DataLoader's workers do), so data sets hold immutable data.
#include <cstdint>
#include <vector>

#include "tensor/tensor.h"

namespace mpt::data {

// Inputs and targets of a batch, first dimension the batch.
struct Batch {
  Tensor input;
  Tensor target;
  int64_t size() const { return input.defined() ? input.size(0) : 0; }
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  // The samples at `indices` (each in [0, size())), stacked on the CPU.
  virtual Batch get_batch(const std::vector<int64_t>& indices) const = 0;
};

}  // namespace mpt::data
