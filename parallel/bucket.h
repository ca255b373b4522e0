#pragma once
// How DDP groups gradients for communication: parameters in the order their
// gradients are expected to become ready, packed into buckets of about
// first_cap bytes (the first: communication starts early) then cap bytes
// (later ones: fewer, larger messages). A bucket closes once it reaches its
// cap, so every bucket holds at least one parameter. A gradient of at least
// cap bytes gets a bucket of its own: DDP all-reduces it where it lies
// instead of copying it into a bucket buffer (mlp_large: 805 MB a step).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "parallel/process_group.h"
#include "tensor/tensor.h"

namespace mpt::dist {

// Parameter indices per bucket. `order` lists parameter indices, `bytes[i]`
// is parameter i's gradient size.
std::vector<std::vector<size_t>> assign_buckets(const std::vector<size_t>& order, const std::vector<size_t>& bytes,
                                                size_t first_cap, size_t cap);

// One bucket's flat buffer and where each of its gradients sits in it.
struct Bucket {
  std::vector<size_t> params;    // parameter indices, in bucket order
  std::vector<int64_t> offsets;  // element offset of each in `flat`
  int64_t elements = 0;          // the buffer's size (gradients and padding)
  DType dtype = DType::f32;      // the transit dtype
  Tensor flat;                   // the communication buffer, while in use
  int64_t arena_offset = -1;     // where `flat` lies in DDP's registered arena; -1: allocated per use
  size_t pending = 0;            // gradients not yet ready this iteration
  WorkPtr work;                  // the running all-reduce, once launched
};


}  // namespace mpt::dist
