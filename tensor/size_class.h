#pragma once
// The size classes both caching allocators (the CUDA one and the host
// block cache) round large requests to: eight steps per power of two, so a
// class is at most 1/8 over its request and blocks of nearby sizes serve
// each other.
#include <algorithm>
#include <bit>
#include <cstddef>

namespace mpt {

// Requests above this are refused before any rounding, which keeps the
// arithmetic clear of overflow; no machine has anywhere near it.
inline constexpr size_t kMaxAllocationRequest = size_t{1} << 62;

// 1 MiB, 1.125 MiB, ... 1.875 MiB, 2 MiB, 2.25 MiB, ...: nbytes rounded up
// to a multiple of an eighth of its largest power of two.
inline constexpr size_t eighth_power_of_two_class(size_t nbytes) {
  const size_t step = std::max<size_t>(std::bit_floor(nbytes) / 8, 1);
  return (nbytes + step - 1) / step * step;
}

}  // namespace mpt
