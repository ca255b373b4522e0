// tensor/fp8.h against cuda_fp8.h's own conversions, compiled for the host:
// its __nv_cvt_* functions are __host__ __device__, and on the host they run
// the C code that defines them (on the GPU the saturating float -> fp8 and
// the fp8 -> f16 conversions are single cvt instructions instead; the GPU
// tests compare the device's casts with the CPU's). Every float bit pattern
// in both formats and both saturation modes, every f16 and bf16, every fp8
// code decoded, and doubles at and around every rounding boundary. Needs the
// CUDA headers, not a GPU: built only where the CUDA backend is.
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include "tensor/fp8.h"

namespace mpt {
namespace {

constexpr __nv_fp8_interpretation_t interpretation(Fp8Format f) { return f == Fp8Format::e4m3 ? __NV_E4M3 : __NV_E5M2; }
constexpr __nv_saturation_t saturation(Fp8Saturation s) { return s == Fp8Saturation::finite ? __NV_SATFINITE : __NV_NOSAT; }

const char* name(Fp8Format f) { return f == Fp8Format::e4m3 ? "e4m3" : "e5m2"; }
const char* name(Fp8Saturation s) { return s == Fp8Saturation::finite ? "satfinite" : "nosat"; }

constexpr Fp8Format kFormats[] = {Fp8Format::e4m3, Fp8Format::e5m2};
constexpr Fp8Saturation kSaturations[] = {Fp8Saturation::none, Fp8Saturation::finite};

// Calls check(bits) for every 32-bit pattern, spread over the machine's
// threads; returns how many failed and the lowest that did.
template <typename Check>
std::pair<uint64_t, uint32_t> over_all_floats(Check check) {
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  std::atomic<uint64_t> failures{0};
  std::atomic<uint32_t> first{UINT32_MAX};
  std::vector<std::thread> pool;
  const uint64_t chunk = ((uint64_t{1} << 32) + threads - 1) / threads;
  for (unsigned t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      const uint64_t begin = t * chunk, end = std::min<uint64_t>(begin + chunk, uint64_t{1} << 32);
      uint64_t local = 0;
      uint32_t local_first = UINT32_MAX;
      for (uint64_t b = begin; b < end; ++b)
        if (!check(static_cast<uint32_t>(b))) {
          if (local++ == 0) local_first = static_cast<uint32_t>(b);
        }
      failures += local;
      uint32_t seen = first.load();
      while (local_first < seen && !first.compare_exchange_weak(seen, local_first)) {
      }
    });
  for (auto& th : pool) th.join();
  return {failures.load(), first.load()};
}

// The format and saturation are template arguments, so that both
// conversions specialise on them: a third of the time of passing them at
// run time.
template <Fp8Format f, Fp8Saturation s>
void expect_every_float_converts_as_cuda_does() {
  const auto [failures, first] = over_all_floats([](uint32_t bits) {
    const float x = bits_float(bits);
    return float_to_fp8_bits(x, f, s) == __nv_cvt_float_to_fp8(x, saturation(s), interpretation(f));
  });
  EXPECT_EQ(failures, 0u) << name(f) << " " << name(s) << ": first differing float bits " << std::hex << first
                          << ": ours " << int(float_to_fp8_bits(bits_float(first), f, s)) << ", CUDA's "
                          << int(__nv_cvt_float_to_fp8(bits_float(first), saturation(s), interpretation(f)));
}

TEST(Fp8VsCuda, EveryFloatInBothFormatsAndSaturations) {
  expect_every_float_converts_as_cuda_does<Fp8Format::e4m3, Fp8Saturation::none>();
  expect_every_float_converts_as_cuda_does<Fp8Format::e4m3, Fp8Saturation::finite>();
  expect_every_float_converts_as_cuda_does<Fp8Format::e5m2, Fp8Saturation::none>();
  expect_every_float_converts_as_cuda_does<Fp8Format::e5m2, Fp8Saturation::finite>();
}

TEST(Fp8VsCuda, EveryHalfAndBFloat16) {
  for (Fp8Format f : kFormats)
    for (Fp8Saturation s : kSaturations)
      for (uint32_t b = 0; b < 0x10000; ++b) {
        const auto bits = static_cast<uint16_t>(b);
        __half_raw h;
        h.x = bits;
        __nv_bfloat16_raw bf;
        bf.x = bits;
        ASSERT_EQ(half_bits_to_fp8_bits(bits, f, s), __nv_cvt_halfraw_to_fp8(h, saturation(s), interpretation(f)))
            << name(f) << " " << name(s) << " from f16 bits " << std::hex << b;
        ASSERT_EQ(bf16_bits_to_fp8_bits(bits, f, s), __nv_cvt_bfloat16raw_to_fp8(bf, saturation(s), interpretation(f)))
            << name(f) << " " << name(s) << " from bf16 bits " << std::hex << b;
      }
}

// f16 bits exactly; float values exactly, NaN as NaN: the host code widens
// the f16 NaN 0x7FFF to the float 0x7FFFFFFF, the GPU's cvt.f32.f16 (and
// half_bits_to_float) to 0x7FFFE000.
TEST(Fp8VsCuda, EveryCodeDecoded) {
  for (Fp8Format f : kFormats)
    for (uint32_t c = 0; c < 256; ++c) {
      const auto code = static_cast<uint8_t>(c);
      ASSERT_EQ(fp8_bits_to_half_bits(code, f), __nv_cvt_fp8_to_halfraw(code, interpretation(f)).x)
          << name(f) << " code " << std::hex << c;
      __nv_fp8_e4m3 e4;
      __nv_fp8_e5m2 e5;
      e4.__x = code;
      e5.__x = code;
      const float theirs = f == Fp8Format::e4m3 ? static_cast<float>(e4) : static_cast<float>(e5);
      const float ours = fp8_bits_to_float(code, f);
      if (std::isnan(theirs)) {
        ASSERT_TRUE(std::isnan(ours)) << name(f) << " code " << std::hex << c;
        EXPECT_EQ(float_bits(ours), 0x7FFFE000u);
      } else {
        ASSERT_EQ(float_bits(ours), float_bits(theirs)) << name(f) << " code " << std::hex << c;
      }
    }
}

// Doubles round once (__nv_cvt_double_to_fp8), which the round-to-odd
// float keeps: checked where a second rounding would show, at every
// midpoint between neighbouring codes and a double's ulp or a float's half
// ulp either side, and over random doubles of every magnitude. NaN is left
// out: the double conversion keeps the sign (and, for e5m2, two payload
// bits) that the float one drops, and fp8.h drops them for doubles too.
TEST(Fp8VsCuda, DoublesRoundOnce) {
  for (Fp8Format f : kFormats)
    for (Fp8Saturation s : kSaturations) {
      std::vector<double> xs;
      for (uint32_t c = 0; c < 0x7F; ++c) {
        const double lo = fp8_bits_to_float(static_cast<uint8_t>(c), f);
        const double hi = fp8_bits_to_float(static_cast<uint8_t>(c + 1), f);
        if (!std::isfinite(lo)) continue;
        // Above the largest finite value: where the next code would be.
        const int m = f == Fp8Format::e4m3 ? 3 : 2;
        const double mid = std::isfinite(hi) ? (lo + hi) / 2 : lo + std::ldexp(1.0, std::ilogb(lo) - m - 1);
        for (double d : {mid, std::nextafter(mid, 0.0), std::nextafter(mid, 1e300), mid * (1 + std::ldexp(1.0, -25)),
                         mid * (1 - std::ldexp(1.0, -25)), mid * (1 + std::ldexp(1.0, -40)), lo, hi})
          if (!std::isnan(d)) {
            xs.push_back(d);
            xs.push_back(-d);
          }
      }
      std::mt19937_64 rng(12345);
      for (int i = 0; i < 1000000; ++i) {
        const double d = std::bit_cast<double>(rng());
        if (!std::isnan(d)) xs.push_back(d);
      }
      for (double d : {0.0, -0.0, 1e300, -1e300, 3.5e38, 1e-300, HUGE_VAL, -HUGE_VAL}) xs.push_back(d);
      for (double d : xs)
        ASSERT_EQ(double_to_fp8_bits(d, f, s), __nv_cvt_double_to_fp8(d, saturation(s), interpretation(f)))
            << name(f) << " " << name(s) << " of " << std::hexfloat << d;
    }
}

}  // namespace
}  // namespace mpt
