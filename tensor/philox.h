#pragma once
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC'11): a counter-based generator. The same header compiles for host and
// device, so the CPU and the GPU draw the same numbers for the same
// (seed, counter), whatever the launch shape.
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define MPT_HD __host__ __device__ __forceinline__
#else
#define MPT_HD inline
#endif

namespace mpt {

struct Philox4 {
  uint32_t v[4];
};

MPT_HD uint32_t mulhilo32(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
}

MPT_HD Philox4 philox4x32_10(uint64_t counter, uint64_t key) {
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = mulhilo32(0xD2511F53u, c0, &hi0);
    const uint32_t lo1 = mulhilo32(0xCD9E8D57u, c2, &hi1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// [0, 1) with 24 random bits: exact in f32.
MPT_HD double philox_uniform(uint32_t x) { return static_cast<double>(x >> 8) * (1.0 / 16777216.0); }

// Uniform element i of a stream that starts at block `offset`.
MPT_HD double philox_uniform_at(uint64_t seed, uint64_t offset, uint64_t i) {
  const Philox4 r = philox4x32_10(offset + i / 4, seed);
  return philox_uniform(r.v[i % 4]);
}

// Standard normal element i: Box-Muller on lanes (0,1) or (2,3) of block i/4,
// in f64 so that both devices round the same value to f32.
MPT_HD double philox_normal_at(uint64_t seed, uint64_t offset, uint64_t i) {
  const Philox4 r = philox4x32_10(offset + i / 4, seed);
  const int pair = static_cast<int>(i % 4) / 2;
  const double u1 = (static_cast<double>(r.v[2 * pair] >> 8) + 1.0) * (1.0 / 16777216.0);  // (0, 1]
  const double u2 = philox_uniform(r.v[2 * pair + 1]);
  // The C library's functions by their global names, which host and device
  // code share (an unqualified `log` would also see mpt's tensor ops).
  const double radius = ::sqrt(-2.0 * ::log(u1));
  const double angle = 6.283185307179586 * u2;
  return (i % 2 == 0) ? radius * ::cos(angle) : radius * ::sin(angle);
}

}  // namespace mpt
