// The CUDA backend against the CPU backend, on fresh random inputs (the seed
// is printed on failure): every op and dtype, casts bit for bit, the caching
// allocator, streams and events. Every test skips without a GPU.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tensor/cuda/gemm.h"
#include "tensor/device_guard.h"
#include "tensor/memory.h"
#include "tensor/ops.h"
#include "tensor/pinned.h"
#include "tensor/step_timer.h"
#include "tensor/stream.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

using testing::host_f64;
using testing::tolerance;

const Device kCuda0{DeviceType::cuda, 0};
const DType kFloatTypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16};

// Raw bytes of a tensor's elements, in row-major order, on the host.
std::vector<uint8_t> raw_bytes(const Tensor& t) {
  const Tensor h = prim::contiguous(prim::to(t, kCPU));
  const auto* p = static_cast<const uint8_t*>(h.data_ptr());
  return std::vector<uint8_t>(p, p + h.nbytes());
}

// Fails with the first differing element unless both hold the same bits.
void expect_same_bits(const Tensor& gpu, const Tensor& cpu, const std::string& what) {
  ASSERT_EQ(gpu.dtype(), cpu.dtype()) << what;
  ASSERT_EQ(gpu.shape(), cpu.shape()) << what;
  const std::vector<uint8_t> g = raw_bytes(gpu), c = raw_bytes(cpu);
  const size_t es = gpu.element_size();
  for (size_t i = 0; i < g.size(); i += es) {
    if (std::memcmp(&g[i], &c[i], es) != 0) {
      const auto gv = host_f64(gpu), cv = host_f64(cpu);
      ADD_FAILURE() << what << ": element " << i / es << " differs: gpu " << gv[i / es] << ", cpu " << cv[i / es];
      return;
    }
  }
}

// |gpu - cpu| <= rtol * |cpu| + atol element by element, NaN matching NaN.
void expect_close(const std::vector<double>& gpu, const std::vector<double>& cpu, double rtol, double atol,
                  const std::string& what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  for (size_t i = 0; i < gpu.size(); ++i) {
    const double g = gpu[i], c = cpu[i];
    if (std::isnan(g) || std::isnan(c)) {
      if (std::isnan(g) != std::isnan(c)) {
        ADD_FAILURE() << what << ": element " << i << ": gpu " << g << ", cpu " << c;
        return;
      }
      continue;
    }
    if (std::isinf(g) || std::isinf(c)) {
      if (g != c) {
        ADD_FAILURE() << what << ": element " << i << ": gpu " << g << ", cpu " << c;
        return;
      }
      continue;
    }
    if (std::fabs(g - c) > rtol * std::fabs(c) + atol) {
      ADD_FAILURE() << what << ": element " << i << ": gpu " << g << ", cpu " << c << " (|diff| "
                    << std::fabs(g - c) << " > " << rtol * std::fabs(c) + atol << ")";
      return;
    }
  }
}

// For results that the two devices compute in a different order or with
// different (correctly rounded or few-ulp) functions.
void expect_close(const Tensor& gpu, const Tensor& cpu, const std::string& what) {
  ASSERT_TRUE(gpu.device().is_cuda()) << what;
  ASSERT_EQ(gpu.shape(), cpu.shape()) << what;
  const double rtol = tolerance(cpu.dtype());
  expect_close(host_f64(gpu), host_f64(cpu), rtol, rtol / 10, what);
}

// For products: |gpu - cpu| <= 2 tol (|a| @ |b|) element by element, the
// scale of the rounding errors of the sums (which the devices add up in
// different orders). Also holds after a 1-Lipschitz function such as tanh.
void expect_matmul_close(const Tensor& gpu, const Tensor& cpu, const Tensor& a, const Tensor& b,
                         const std::string& what) {
  ASSERT_EQ(gpu.shape(), cpu.shape()) << what;
  const Tensor bound = prim::matmul(prim::unary(UnaryOp::abs, prim::to(a, DType::f64)),
                                    prim::unary(UnaryOp::abs, prim::to(b, DType::f64)));
  const double tol = tolerance(cpu.dtype());
  const auto gv = host_f64(gpu), cv = host_f64(cpu), bv = host_f64(bound);
  for (size_t i = 0; i < gv.size(); ++i) {
    if (!(std::fabs(gv[i] - cv[i]) <= 2 * tol * (bv[i] + std::fabs(cv[i])))) {
      ADD_FAILURE() << what << ": element " << i << ": gpu " << gv[i] << ", cpu " << cv[i] << ", |a| @ |b| "
                    << bv[i];
      return;
    }
  }
}

class CudaTensor : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::has_cuda()) GTEST_SKIP() << "skipped: no CUDA device";
    seed_ = testing::fresh_seed();
    gen_.manual_seed(seed_);
  }

  // Inputs are drawn on the CPU and copied, so both devices see the same values.
  Tensor randn(const Shape& s, DType dt) { return mpt::randn(s, dt, kCPU, &gen_); }
  Tensor rand(const Shape& s, DType dt, double lo, double hi) { return mpt::rand(s, dt, kCPU, &gen_, lo, hi); }
  static Tensor gpu(const Tensor& t) { return prim::to(t, kCuda0); }
  std::string trace() const { return fmt::format("seed {}", seed_); }

  uint64_t seed_ = 0;
  Generator gen_;
};

// ---- element-wise ---------------------------------------------------------------

TEST_F(CudaTensor, EveryUnaryOpMatchesTheCpu) {
  SCOPED_TRACE(trace());
  for (DType dt : kFloatTypes) {
    for (int i = 0; i <= static_cast<int>(UnaryOp::step); ++i) {
      const auto op = static_cast<UnaryOp>(i);
      const bool positive = op == UnaryOp::log || op == UnaryOp::sqrt || op == UnaryOp::rsqrt ||
                            op == UnaryOp::reciprocal || op == UnaryOp::pow_scalar;
      const double alpha = op == UnaryOp::pow_scalar ? 1.7 : 2.5, beta = -0.75;
      const std::string what = fmt::format("{} {}", unary_op_name(op), dtype_name(dt));
      // Odd sizes leave a tail after the 16-byte packs.
      Tensor x = positive ? rand({37, 129}, dt, 0.2, 4.0) : rand({37, 129}, dt, -4.0, 4.0);
      Tensor gx = gpu(x);
      expect_close(prim::unary(op, gx, alpha, beta), prim::unary(op, x, alpha, beta), what + " contiguous");
      // Transposed (strided) input.
      expect_close(prim::unary(op, prim::transpose(gx, 0, 1), alpha, beta),
                   prim::unary(op, prim::transpose(x, 0, 1), alpha, beta), what + " transposed");
      // Contiguous but not 16-byte aligned: the unpacked path.
      expect_close(prim::unary(op, prim::slice(prim::view(gx, {-1}), 0, 1, 4000), alpha, beta),
                   prim::unary(op, prim::slice(prim::view(x, {-1}), 0, 1, 4000), alpha, beta), what + " unaligned");
      // Broadcast input (stride 0) into a larger output.
      Tensor row = prim::slice(x, 0, 0, 1);
      Tensor out_cpu = Tensor::empty({5, 129}, dt, kCPU), out_gpu = Tensor::empty({5, 129}, dt, kCuda0);
      prim::unary_(op, out_cpu, row, alpha, beta);
      prim::unary_(op, out_gpu, gpu(row), alpha, beta);
      expect_close(out_gpu, out_cpu, what + " broadcast");
    }
  }
}

TEST_F(CudaTensor, EveryBinaryOpMatchesTheCpu) {
  SCOPED_TRACE(trace());
  for (DType dt : kFloatTypes) {
    for (int i = 0; i <= static_cast<int>(BinaryOp::sigmoid_backward); ++i) {
      const auto op = static_cast<BinaryOp>(i);
      const bool positive = op == BinaryOp::pow || op == BinaryOp::div;
      const std::string what = fmt::format("{} {}", binary_op_name(op), dtype_name(dt));
      const double lo = positive ? 0.2 : -3.0, hi = 3.0;
      // 64 columns: rows of whole 16-byte packs; 65: element by element.
      for (int64_t cols : {64, 65}) {
        Tensor a = rand({33, cols}, dt, lo, hi);
        // Equal in the lower rows, so that the comparisons see ties.
        Tensor b = prim::clone(a);
        prim::copy_(prim::slice(b, 0, 0, 16), rand({16, cols}, dt, lo, hi));
        Tensor ga = gpu(a), gb = gpu(b);
        expect_close(prim::binary(op, ga, gb), prim::binary(op, a, b), what + " contiguous");

        // Broadcasting: a row vector, a column vector, a scalar.
        Tensor row = rand({cols}, dt, lo, hi), col = rand({33, 1}, dt, lo, hi), one = rand({}, dt, lo, hi);
        expect_close(prim::binary(op, ga, gpu(row)), prim::binary(op, a, row), what + " row broadcast");
        expect_close(prim::binary(op, gpu(col), ga), prim::binary(op, col, a), what + " column broadcast");
        expect_close(prim::binary(op, ga, gpu(one)), prim::binary(op, a, one), what + " scalar broadcast");

        // Transposed operands.
        Tensor at = prim::transpose(rand({cols, 33}, dt, lo, hi), 0, 1);
        expect_close(prim::binary(op, gpu(at), gb), prim::binary(op, at, b), what + " transposed");
      }
    }
  }
}

// An f32 result of one f32 and one 16-bit input: the GPU widens the 16-bit
// input as it loads it, the CPU casts it first; the same f32 arithmetic,
// so the same bits. Either side 16-bit, packed, tail, broadcast, strided.
TEST_F(CudaTensor, BinaryOpsOfF32AndSixteenBitsMatchTheCpuBitForBit) {
  SCOPED_TRACE(trace());
  for (DType low : {DType::f16, DType::bf16})
    for (BinaryOp op : {BinaryOp::add, BinaryOp::sub, BinaryOp::mul, BinaryOp::div, BinaryOp::maximum}) {
      const std::string what = fmt::format("{} f32 with {}", binary_op_name(op), dtype_name(low));
      for (int64_t cols : {64, 65}) {
        const Tensor a = rand({33, cols}, DType::f32, 0.2, 3.0), b = rand({33, cols}, low, 0.2, 3.0);
        const Tensor row = rand({cols}, low, 0.2, 3.0);
        const Tensor at = prim::transpose(rand({cols, 33}, low, 0.2, 3.0), 0, 1);
        const std::vector<std::pair<Tensor, Tensor>> pairs{{a, b}, {b, a}, {a, row}, {row, a}, {a, at}};
        for (size_t i = 0; i < pairs.size(); ++i) {
          const auto& [x, y] = pairs[i];
          const Tensor on_gpu = prim::binary(op, gpu(x), gpu(y));
          ASSERT_EQ(on_gpu.dtype(), DType::f32);
          EXPECT_EQ(host_f64(on_gpu), host_f64(prim::binary(op, x, y))) << what << ", case " << i << ", " << cols;
        }
      }
    }
}

// Ops made of +, -, * and / alone round as on the CPU: neither side fuses a
// multiply and an add.
TEST_F(CudaTensor, ArithmeticOpsMatchTheCpuBitForBit) {
  SCOPED_TRACE(trace());
  for (DType dtype : {DType::f32, DType::f64, DType::f16, DType::bf16}) {
    const Tensor x = rand({1000, 37}, dtype, -3.0, 3.0), y = rand({1000, 37}, dtype, -1.0, 1.0);
    for (const auto& [alpha, beta] : {std::pair{1.0 / 3.0, 0.1}, std::pair{-2.7, 1e-3}}) {
      const Tensor cpu = prim::unary(UnaryOp::affine, x, alpha, beta);
      EXPECT_EQ(host_f64(prim::unary(UnaryOp::affine, gpu(x), alpha, beta)), host_f64(cpu))
          << "affine " << alpha << ", " << beta << " in " << dtype_name(dtype);
    }
    for (UnaryOp op : {UnaryOp::square, UnaryOp::reciprocal})
      EXPECT_EQ(host_f64(prim::unary(op, gpu(x))), host_f64(prim::unary(op, x)))
          << unary_op_name(op) << " in " << dtype_name(dtype);
    for (BinaryOp op : {BinaryOp::tanh_backward, BinaryOp::sigmoid_backward, BinaryOp::mul, BinaryOp::div})
      EXPECT_EQ(host_f64(prim::binary(op, gpu(x), gpu(y))), host_f64(prim::binary(op, x, y)))
          << binary_op_name(op) << " in " << dtype_name(dtype);
  }
}

TEST_F(CudaTensor, ElementwiseNaNPropagatesLikeTheCpu) {
  const std::vector<float> values = {NAN, 1.0f, -2.0f, NAN, 0.0f, -0.0f};
  const std::vector<float> others = {1.0f, NAN, -3.0f, NAN, -0.0f, 0.0f};
  Tensor a = from_vector(values, {6}), b = from_vector(others, {6});
  for (BinaryOp op : {BinaryOp::maximum, BinaryOp::minimum, BinaryOp::relu_backward}) {
    expect_close(prim::binary(op, gpu(a), gpu(b)), prim::binary(op, a, b), binary_op_name(op));
  }
  expect_close(prim::unary(UnaryOp::relu, gpu(a)), prim::unary(UnaryOp::relu, a), "relu");
}

// ---- copies and casts -----------------------------------------------------------

TEST_F(CudaTensor, CastsBetweenAllDTypesMatchTheCpuBitForBit) {
  SCOPED_TRACE(trace());
  for (DType src : kAllDTypes) {
    for (DType dst : kAllDTypes) {
      const std::string what = fmt::format("{} -> {}", dtype_name(src), dtype_name(dst));
      // Keep values where every conversion is defined (u8 has no negatives).
      const bool non_negative = src == DType::u8 || dst == DType::u8;
      Tensor x = prim::to(rand({19, 23}, DType::f64, non_negative ? 0.0 : -300.0, 250.0), src);
      Tensor gx = gpu(x);
      expect_same_bits(prim::to(gx, dst), prim::to(x, dst), what);
      // Strided source.
      Tensor xt = prim::transpose(x, 0, 1);
      expect_same_bits(prim::to(prim::transpose(gx, 0, 1), dst), prim::to(xt, dst), what + " transposed");
    }
  }
}

TEST_F(CudaTensor, HalfConversionsAreBitIdenticalOverAllExponents) {
  SCOPED_TRACE(trace());
  std::mt19937_64 rng(seed_);
  // f32 and f64 from random bit patterns (NaN payloads may differ, so none).
  std::vector<float> f32;
  std::vector<double> f64;
  while (f32.size() < 100000) {
    const auto bits = static_cast<uint32_t>(rng());
    float f;
    std::memcpy(&f, &bits, 4);
    if (!std::isnan(f)) f32.push_back(f);
  }
  while (f64.size() < 100000) {
    // Exponents near the half range, where double rounding would show.
    const double d = std::ldexp(static_cast<double>(rng()) / 18446744073709551616.0 + 0.5,
                                static_cast<int>(rng() % 60) - 40);
    f64.push_back(rng() % 2 ? d : -d);
  }
  for (float edge : {65504.0f, 65519.996f, 65520.0f, 70000.0f, -70000.0f, 5.9604645e-8f, 2.9802322e-8f,
                     1.00048828125f, 1.00146484375f, -0.0f, INFINITY, -INFINITY, 3.3895314e38f})
    f32.push_back(edge);
  Tensor x32 = from_vector<float>(f32, {static_cast<int64_t>(f32.size())}, DType::f32);
  Tensor x64 = from_vector<double>(f64, {static_cast<int64_t>(f64.size())}, DType::f64);
  for (DType dst : {DType::f16, DType::bf16}) {
    expect_same_bits(prim::to(gpu(x32), dst), prim::to(x32, dst), fmt::format("f32 -> {}", dtype_name(dst)));
    expect_same_bits(prim::to(gpu(x64), dst), prim::to(x64, dst), fmt::format("f64 -> {}", dtype_name(dst)));
  }
  expect_same_bits(prim::to(gpu(x64), DType::f32), prim::to(x64, DType::f32), "f64 -> f32");

  // Every non-NaN 16-bit pattern back to f32.
  std::vector<Half> h;
  std::vector<BFloat16> bf;
  for (uint32_t b = 0; b < 65536; ++b) {
    const Half hv = Half::from_bits(static_cast<uint16_t>(b));
    if (!std::isnan(static_cast<float>(hv))) h.push_back(hv);
    const BFloat16 bv = BFloat16::from_bits(static_cast<uint16_t>(b));
    if (!std::isnan(static_cast<float>(bv))) bf.push_back(bv);
  }
  Tensor th = from_vector<Half>(h, {static_cast<int64_t>(h.size())}, DType::f16);
  Tensor tb = from_vector<BFloat16>(bf, {static_cast<int64_t>(bf.size())}, DType::bf16);
  expect_same_bits(prim::to(gpu(th), DType::f32), prim::to(th, DType::f32), "f16 -> f32");
  expect_same_bits(prim::to(gpu(tb), DType::f32), prim::to(tb, DType::f32), "bf16 -> f32");
  expect_same_bits(prim::to(gpu(th), DType::bf16), prim::to(th, DType::bf16), "f16 -> bf16");
}

// Like expect_same_bits, but where the CPU's element is NaN the GPU's need
// only be NaN: casts out of float8 widen its NaN through each device's own
// conversions, which agree on NaN but not on its payload.
void expect_same_bits_or_nan(const Tensor& gpu, const Tensor& cpu, const std::string& what) {
  ASSERT_EQ(gpu.dtype(), cpu.dtype()) << what;
  const std::vector<uint8_t> g = raw_bytes(gpu), c = raw_bytes(cpu);
  ASSERT_EQ(g.size(), c.size()) << what;
  const auto gv = host_f64(gpu), cv = host_f64(cpu);
  const size_t es = gpu.element_size();
  for (size_t i = 0; i < g.size(); i += es) {
    if (std::memcmp(&g[i], &c[i], es) == 0 || (std::isnan(cv[i / es]) && std::isnan(gv[i / es]))) continue;
    ADD_FAILURE() << what << ": element " << i / es << " differs: gpu " << gv[i / es] << ", cpu " << cv[i / es];
    return;
  }
}

Tensor float8_codes(const std::vector<uint8_t>& codes, DType dt) {
  Tensor t = Tensor::empty({static_cast<int64_t>(codes.size())}, dt);
  std::memcpy(t.data_ptr(), codes.data(), codes.size());
  return t;
}

// e4m3 and e5m2: every code cast to every dtype, contiguous and strided; and
// into float8 from f32 (random bits, NaN included, the specials, and both
// sides of every rounding boundary), every f16 and bf16, f64 (where a
// second rounding would show) and the integers. Into float8 every bit
// matches the CPU's (a cast does not saturate: NaN past e4m3's largest
// value, infinity past e5m2's).
TEST_F(CudaTensor, Float8CastsMatchTheCpuBitForBit) {
  SCOPED_TRACE(trace());
  std::mt19937_64 rng(seed_);
  for (DType f8 : {DType::e4m3, DType::e5m2}) {
    const Fp8Format format = f8 == DType::e4m3 ? Fp8Format::e4m3 : Fp8Format::e5m2;
    std::vector<uint8_t> all(256);
    for (int c = 0; c < 256; ++c) all[c] = static_cast<uint8_t>(c);
    for (DType dst : kAllDTypes) {
      // Integers take the codes whose values they hold (converting NaN,
      // infinity or a value out of range is undefined).
      std::vector<uint8_t> codes;
      for (uint8_t c : all) {
        const float v = fp8_bits_to_float(c, format);
        const bool fits = dst == DType::u8 ? v >= 0 && v < 256 : std::isfinite(v);
        if (is_floating(dst) || fits) codes.push_back(c);
      }
      const Tensor x = float8_codes(codes, f8);
      const std::string what = fmt::format("{} codes -> {}", dtype_name(f8), dtype_name(dst));
      expect_same_bits_or_nan(prim::to(gpu(x), dst), prim::to(x, dst), what);
      const Tensor strided = prim::slice(x, 0, 1, x.numel(), 3);
      expect_same_bits_or_nan(prim::to(prim::slice(gpu(x), 0, 1, x.numel(), 3), dst), prim::to(strided, dst),
                              what + " strided");
    }

    std::vector<float> f32;
    while (f32.size() < 200000) f32.push_back(bits_float(static_cast<uint32_t>(rng())));
    for (int c = 0; c < 0x7F; ++c) {
      const float lo = fp8_bits_to_float(static_cast<uint8_t>(c), format);
      const float hi = fp8_bits_to_float(static_cast<uint8_t>(c + 1), format);
      if (!std::isfinite(lo)) continue;
      // The midpoint to the next code, or to where it would be past the largest.
      const float below = c > 0 ? fp8_bits_to_float(static_cast<uint8_t>(c - 1), format) : 0.0f;
      const float mid = std::isfinite(hi) ? (lo + hi) / 2 : lo + (lo - below) / 2;
      for (float v : {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) {
        f32.push_back(v);
        f32.push_back(-v);
      }
    }
    for (float v : {INFINITY, -INFINITY, NAN, -NAN, 1e30f, -1e-30f, 0.0f, -0.0f}) f32.push_back(v);
    const Tensor x32 = from_vector<float>(f32, {static_cast<int64_t>(f32.size())}, DType::f32);
    expect_same_bits(prim::to(gpu(x32), f8), prim::to(x32, f8), fmt::format("f32 -> {}", dtype_name(f8)));
    expect_same_bits(prim::to(prim::slice(gpu(x32), 0, 0, x32.numel(), 2), f8),
                     prim::to(prim::slice(x32, 0, 0, x32.numel(), 2), f8),
                     fmt::format("f32 -> {} strided", dtype_name(f8)));

    std::vector<Half> h;
    std::vector<BFloat16> bf;
    for (uint32_t b = 0; b < 65536; ++b) {
      h.push_back(Half::from_bits(static_cast<uint16_t>(b)));
      bf.push_back(BFloat16::from_bits(static_cast<uint16_t>(b)));
    }
    const Tensor th = from_vector<Half>(h, {65536}, DType::f16);
    const Tensor tb = from_vector<BFloat16>(bf, {65536}, DType::bf16);
    expect_same_bits(prim::to(gpu(th), f8), prim::to(th, f8), fmt::format("f16 -> {}", dtype_name(f8)));
    expect_same_bits(prim::to(gpu(tb), f8), prim::to(tb, f8), fmt::format("bf16 -> {}", dtype_name(f8)));

    std::vector<double> f64;
    for (float v : f32)
      if (std::isfinite(v) && std::fabs(v) < 1e5f) f64.push_back(static_cast<double>(v) * (1 + 0x1p-40));
    for (int i = 0; i < 100000; ++i) f64.push_back(std::bit_cast<double>(rng()));
    const Tensor x64 = from_vector<double>(f64, {static_cast<int64_t>(f64.size())}, DType::f64);
    expect_same_bits(prim::to(gpu(x64), f8), prim::to(x64, f8), fmt::format("f64 -> {}", dtype_name(f8)));

    const std::vector<int64_t> ints = {0, 1, -1, 17, 300, 448, 449, 465, 60000, 61440, -1000000, int64_t{1} << 40};
    const Tensor ti = from_vector<int64_t>(ints, {static_cast<int64_t>(ints.size())}, DType::i64);
    expect_same_bits(prim::to(gpu(ti), f8), prim::to(ti, f8), fmt::format("i64 -> {}", dtype_name(f8)));
    expect_same_bits(prim::to(gpu(prim::to(ti, DType::i32)), f8), prim::to(prim::to(ti, DType::i32), f8),
                     fmt::format("i32 -> {}", dtype_name(f8)));
    const Tensor tu = prim::to(arange(0, 256, 1, DType::i32), DType::u8);
    expect_same_bits(prim::to(gpu(tu), f8), prim::to(tu, f8), fmt::format("u8 -> {}", dtype_name(f8)));
  }
}

TEST_F(CudaTensor, PermutedCopiesMatchTheCpu) {
  SCOPED_TRACE(trace());
  for (DType dt : kAllDTypes) {
    // [B, T, H, D] -> [B, H, T, D]: the innermost dimension stays, so rows
    // copy in 16-byte packs; and a permute that moves the innermost one.
    Tensor x = prim::to(rand({2, 5, 3, 16}, DType::f64, 0.0, 100.0), dt);
    Tensor gx = gpu(x);
    expect_same_bits(prim::contiguous(prim::permute(gx, {0, 2, 1, 3})), prim::contiguous(prim::permute(x, {0, 2, 1, 3})),
                     fmt::format("permute {}", dtype_name(dt)));
    expect_same_bits(prim::contiguous(prim::permute(gx, {3, 1, 0, 2})), prim::contiguous(prim::permute(x, {3, 1, 0, 2})),
                     fmt::format("permute innermost {}", dtype_name(dt)));
    // Into a strided destination: the odd columns of a wider matrix.
    Tensor cpu_dst = zeros({30, 32}, dt), gpu_dst = zeros({30, 32}, dt, kCuda0);
    prim::copy_(prim::slice(cpu_dst, 1, 16, 32), prim::reshape(x, {30, 16}));
    prim::copy_(prim::slice(gpu_dst, 1, 16, 32), prim::reshape(gx, {30, 16}));
    expect_same_bits(gpu_dst, cpu_dst, fmt::format("strided destination {}", dtype_name(dt)));
  }
}

// f32 <-> 16-bit casts into and out of rows of a wider block (the packed
// row walk) and at odd offsets (element by element): the CPU's bits.
TEST_F(CudaTensor, CastsBetweenRowsOfAWiderBlockMatchTheCpuBitForBit) {
  SCOPED_TRACE(trace());
  for (DType low : {DType::f16, DType::bf16})
    for (const auto& [from, to] : {std::pair{DType::f32, low}, std::pair{low, DType::f32}})
      for (int64_t start : {32, 33}) {  // a whole number of packs in, or one element past
        const std::string what = fmt::format("{} -> {} at column {}", dtype_name(from), dtype_name(to), start);
        const Tensor x = rand({24, 32}, from, -70.0, 70.0);
        Tensor cpu_dst = zeros({24, 96}, to), gpu_dst = zeros({24, 96}, to, kCuda0);
        prim::copy_(prim::slice(cpu_dst, 1, start, start + 32), x);
        prim::copy_(prim::slice(gpu_dst, 1, start, start + 32), gpu(x));
        expect_same_bits(gpu_dst, cpu_dst, what + ", into the block");
        const Tensor block = rand({24, 96}, from, -70.0, 70.0);
        expect_same_bits(prim::to(prim::slice(gpu(block), 1, start, start + 32), to),
                         prim::to(prim::slice(block, 1, start, start + 32), to), what + ", out of the block");
      }
}

TEST_F(CudaTensor, F16OverflowGivesInfinityLikeTheCpu) {
  Tensor x = from_vector(std::vector<float>{70000.f, -70000.f, 65504.f, 65520.f, 1e-9f}, {5});
  Tensor g = prim::to(gpu(x), DType::f16);
  expect_same_bits(g, prim::to(x, DType::f16), "f32 -> f16");
  const auto v = g.to_vector<float>();
  EXPECT_TRUE(std::isinf(v[0]) && v[0] > 0);
  EXPECT_TRUE(std::isinf(v[1]) && v[1] < 0);
  EXPECT_EQ(v[2], 65504.f);
  EXPECT_TRUE(std::isinf(v[3]));
  // Arithmetic that overflows in f16 also gives inf.
  Tensor big = full({4}, 300.0, DType::f16, kCuda0);
  EXPECT_TRUE(std::isinf(prim::mul(big, big).to_vector<float>()[3]));
}

TEST_F(CudaTensor, FillMatchesTheCpuForEveryDType) {
  for (DType dt : kAllDTypes) {
    for (double value : {0.0, 3.7, -2.5, 70000.0, 1e-3}) {
      if (dt == DType::u8 && value < 0) continue;
      const std::string what = fmt::format("fill {} {}", dtype_name(dt), value);
      expect_same_bits(full({3, 17}, value, dt, kCuda0), full({3, 17}, value, dt, kCPU), what);
      // Strided destination: every other column of a zeroed matrix.
      Tensor c = zeros({4, 10}, dt, kCPU), g = zeros({4, 10}, dt, kCuda0);
      prim::fill_(prim::slice(c, 1, 0, 10, 2), value);
      prim::fill_(prim::slice(g, 1, 0, 10, 2), value);
      expect_same_bits(g, c, what + " strided");
    }
  }
}

TEST_F(CudaTensor, ArangeMatchesTheCpuForEveryDType) {
  for (DType dt : kAllDTypes) {
    const double start = dt == DType::u8 ? 1.0 : -3.5;
    expect_same_bits(arange(start, 40.0, 0.3, dt, kCuda0), arange(start, 40.0, 0.3, dt, kCPU),
                     fmt::format("arange {}", dtype_name(dt)));
  }
}

TEST_F(CudaTensor, DeviceRoundTripIsExactForEveryDType) {
  SCOPED_TRACE(trace());
  for (DType dt : kAllDTypes) {
    Tensor x = prim::to(rand({1001}, DType::f64, 0.0, 200.0), dt);
    Tensor back = prim::to(gpu(x), kCPU);
    EXPECT_TRUE(back.device().is_cpu());
    expect_same_bits(back, x, fmt::format("round trip {}", dtype_name(dt)));
    // A strided source crosses too.
    Tensor xt = prim::transpose(prim::view(x, {7, 143}), 0, 1);
    expect_same_bits(prim::to(prim::to(xt, kCuda0), kCPU), xt, fmt::format("strided round trip {}", dtype_name(dt)));
  }
}

TEST_F(CudaTensor, CopiesBetweenTwoGpus) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "skipped: needs 2 CUDA devices";
  SCOPED_TRACE(trace());
  const Device cuda1{DeviceType::cuda, 1};
  Tensor x = randn({64, 33}, DType::f32);
  Tensor on1 = prim::to(gpu(x), cuda1);
  EXPECT_EQ(on1.device(), cuda1);
  expect_same_bits(on1, x, "cuda:0 -> cuda:1");
  // Strided, with a dtype change on the way.
  Tensor dst = Tensor::empty({33, 64}, DType::f16, cuda1);
  prim::copy_(dst, prim::transpose(gpu(x), 0, 1));
  expect_same_bits(dst, prim::to(prim::transpose(x, 0, 1), DType::f16), "cuda:0 -> cuda:1 transposed f16");
  // Work on the second device runs there.
  expect_matmul_close(prim::matmul(on1, prim::transpose(on1, 0, 1)), prim::matmul(x, prim::transpose(x, 0, 1)), x,
                      prim::transpose(x, 0, 1), "matmul on cuda:1");
  expect_same_bits(prim::to(on1, kCuda0), x, "cuda:1 -> cuda:0");
}

// ---- reductions -----------------------------------------------------------------

TEST_F(CudaTensor, ReductionsMatchTheCpu) {
  SCOPED_TRACE(trace());
  struct Case {
    Shape shape;
    std::vector<int64_t> dims;
  };
  // Small and long rows (warp and block per row), columns, mixed dims, and
  // shapes with few outputs and long k, which split k across blocks.
  const std::vector<Case> cases = {
      {{7, 300, 5}, {1}}, {{7, 300, 5}, {2}}, {{7, 300, 5}, {0}}, {{7, 300, 5}, {0, 2}}, {{7, 300, 5}, {}},
      {{64, 3000}, {1}},  {{3, 200000}, {1}}, {{3, 100001}, {1}}, {{200000, 3}, {0}},  {{50000, 40}, {0}},
      {{1}, {0}},
  };
  const ReduceOp ops[] = {ReduceOp::sum, ReduceOp::mean, ReduceOp::max, ReduceOp::min, ReduceOp::argmax};
  for (DType dt : kFloatTypes) {
    for (const Case& c : cases) {
      Tensor x = randn(c.shape, dt);
      Tensor gx = gpu(x);
      // Sums are compared relative to the sum of magnitudes: the devices add
      // in a different order, and a sum may cancel to near zero.
      const Tensor magnitude = prim::sum(prim::unary(UnaryOp::abs, prim::to(x, DType::f64)), c.dims);
      for (ReduceOp op : ops) {
        if (op == ReduceOp::argmax && c.dims.size() != 1) continue;
        const std::string what = fmt::format("{} {} {} dims [{}]", reduce_op_name(op), dtype_name(dt),
                                             shape_str(c.shape), fmt::join(c.dims, ","));
        if (op == ReduceOp::argmax) {
          // First index of the maximum on both devices: exactly equal.
          expect_same_bits(prim::argmax(gx, c.dims[0]), prim::argmax(x, c.dims[0]), what);
          continue;
        }
        const Tensor g = prim::reduce(op, gx, c.dims), r = prim::reduce(op, x, c.dims);
        if (op == ReduceOp::max || op == ReduceOp::min) {
          expect_same_bits(g, r, what);
          continue;
        }
        std::vector<double> bound = host_f64(magnitude);
        const int64_t k = x.numel() / std::max<int64_t>(r.numel(), 1);
        std::vector<double> gv = host_f64(g), rv = host_f64(r);
        for (size_t i = 0; i < gv.size(); ++i) {
          const double scale = op == ReduceOp::mean ? bound[i] / static_cast<double>(k) : bound[i];
          ASSERT_LE(std::fabs(gv[i] - rv[i]), 2 * tolerance(dt) * scale + 1e-30) << what << " element " << i;
        }
      }
    }
  }
}

TEST_F(CudaTensor, ReductionsPropagateNaNLikeTheCpu) {
  // Row 0: a clear maximum at 17. Row 1: NaNs at 200 and 400; NaN counts as
  // the maximum, and the first one wins.
  std::vector<float> v(1000, 1.0f);
  v[17] = 5.0f;
  v[500 + 200] = NAN;
  v[500 + 400] = NAN;
  Tensor x = from_vector(v, {2, 500});
  for (ReduceOp op : {ReduceOp::max, ReduceOp::min, ReduceOp::sum})
    expect_close(prim::reduce(op, gpu(x), {1}), prim::reduce(op, x, {1}), reduce_op_name(op));
  expect_same_bits(prim::argmax(gpu(x), 1), prim::argmax(x, 1), "argmax");
  EXPECT_EQ(prim::argmax(gpu(x), 1).to_vector<int64_t>(), (std::vector<int64_t>{17, 200}));
}

// ---- matrix products ------------------------------------------------------------

TEST_F(CudaTensor, MatmulMatchesTheCpu) {
  SCOPED_TRACE(trace());
  struct Case {
    Shape a, b;
    bool transpose_a = false, transpose_b = false;
  };
  const std::vector<Case> cases = {
      {{64, 48}, {48, 80}},
      {{3, 17, 33}, {3, 33, 9}},          // batched
      {{2, 1, 5, 7}, {3, 7, 4}},          // broadcast batch
      {{4, 6, 32}, {32, 16}},             // [..., m, k] @ [k, n]: one GEMM
      {{48, 64}, {80, 48}, true, true},   // both transposed views
      {{5, 40, 24}, {5, 40, 8}, true},    // batched, a transposed
      {{1, 37}, {37, 1}},                 // m = n = 1
  };
  for (DType dt : kFloatTypes) {
    for (const Case& c : cases) {
      const std::string what =
          fmt::format("{} {} @ {}{}{}", dtype_name(dt), shape_str(c.a), shape_str(c.b), c.transpose_a ? " a^T" : "",
                      c.transpose_b ? " b^T" : "");
      Tensor a = randn(c.a, dt), b = randn(c.b, dt);
      if (c.transpose_a) a = prim::transpose(a, -1, -2);
      if (c.transpose_b) b = prim::transpose(b, -1, -2);
      expect_matmul_close(prim::matmul(gpu(a), gpu(b)), prim::matmul(a, b), a, b, what);
    }
    // Matrices whose dimensions of size 1 have stride 0 (expanded from a
    // scalar, as a single query's attention weights over a single key may
    // be): a dimension never stepped along takes any stride.
    const Tensor s = randn({}, dt), v = randn({1, 2, 1, 5}, dt), w = randn({1, 4}, dt);
    expect_matmul_close(prim::matmul(prim::expand(gpu(s), {1, 2, 1, 1}), gpu(v)),
                        prim::matmul(prim::expand(s, {1, 2, 1, 1}), v), prim::expand(s, {1, 2, 1, 1}), v,
                        fmt::format("{} scalar expanded to [1, 2, 1, 1] @ [1, 2, 1, 5]", dtype_name(dt)));
    expect_matmul_close(prim::matmul(prim::expand(gpu(s), {1, 1}), gpu(w)), prim::matmul(prim::expand(s, {1, 1}), w),
                        prim::expand(s, {1, 1}), w, fmt::format("{} scalar expanded to [1, 1] @ [1, 4]", dtype_name(dt)));
  }
}

TEST_F(CudaTensor, GemmAlphaBetaAccumulateIntoTheOutput) {
  SCOPED_TRACE(trace());
  for (DType dt : kFloatTypes) {
    Tensor a = randn({2, 9, 13}, dt), b = randn({2, 13, 11}, dt), c = randn({2, 9, 11}, dt);
    Tensor ga = gpu(a), gb = gpu(b), gc = gpu(c), c_in = prim::clone(c);
    auto run = [](const Tensor& a, const Tensor& b, const Tensor& out) {
      GemmArgs g;
      g.a = a.view();
      g.b = b.view();
      g.out = out.view();
      g.alpha = 2.0f;
      g.beta = 0.5f;
      DeviceGuard guard(out.device());
      backend_for(out.device()).gemm(g);
    };
    run(a, b, c);
    run(ga, gb, gc);
    // 2 |a| @ |b| + 0.5 |c| bounds the terms; the rounding errors scale with it.
    const auto bound = host_f64(prim::add(prim::mul_scalar(prim::matmul(prim::unary(UnaryOp::abs, prim::to(a, DType::f64)),
                                                                        prim::unary(UnaryOp::abs, prim::to(b, DType::f64))),
                                                           2.0),
                                          prim::mul_scalar(prim::unary(UnaryOp::abs, prim::to(c_in, DType::f64)), 0.5)));
    const auto gv = host_f64(gc), cv = host_f64(c);
    for (size_t i = 0; i < gv.size(); ++i)
      ASSERT_LE(std::fabs(gv[i] - cv[i]), 2 * tolerance(dt) * bound[i]) << "alpha/beta " << dtype_name(dt) << " element " << i;
  }
}

// A linear layer's bias in the GEMM's epilogue and its bias gradient in the
// weight gradient's, against the CPU; shapes where cuBLASLt fuses them and
// shapes where it may not (odd sizes, a misaligned bias, a classifier's 10
// outputs whose gradient rows are not 16-byte aligned: separate kernels).
TEST_F(CudaTensor, LinearEpiloguesMatchTheCpu) {
  SCOPED_TRACE(trace());
  struct Case {
    int64_t rows, in, out;
    bool misaligned_bias;
  };
  const Case cases[] = {{256, 784, 1024, false}, {64, 384, 1536, false}, {33, 17, 10, false},
                        {128, 64, 96, true}, {1, 8, 8, false}, {512, 128, 10, false}};
  for (DType dt : kFloatTypes)
    for (const Case& c : cases) {
      const std::string what = fmt::format("{} [{}, {}] -> {}{}", dtype_name(dt), c.rows, c.in, c.out,
                                           c.misaligned_bias ? " (bias at an odd address)" : "");
      const Tensor x = randn({c.rows, c.in}, dt), w = randn({c.out, c.in}, dt), gy = randn({c.rows, c.out}, dt);
      // A large bias (a lost one would stand out of the rounding); at an odd
      // address, a view one element into a longer vector.
      const Tensor b_storage = prim::mul_scalar(randn({c.out + 1}, dt), 100.0);
      const Tensor b = prim::slice(b_storage, 0, c.misaligned_bias ? 1 : 0, c.misaligned_bias ? c.out + 1 : c.out);
      const Tensor y = prim::linear(x, w, b), yg = prim::linear(gpu(x), gpu(w), gpu(b));
      // The same sums as [x, 1] @ [w^T; b], which bounds the rounding.
      const Tensor x1 = prim::cat({x, full({c.rows, 1}, 1.0, dt)}, 1);
      const Tensor wb = prim::cat({prim::transpose(w, 0, 1), prim::unsqueeze(b, 0)}, 0);
      expect_matmul_close(yg, y, x1, wb, what + " forward");
      expect_matmul_close(yg, prim::matmul(x1, wb), x1, wb, what + " forward against the augmented product");
      const auto [gw, gb] = prim::linear_weight_grad(gy, x, true);
      const auto [gw_g, gb_g] = prim::linear_weight_grad(gpu(gy), gpu(x), true);
      expect_matmul_close(gw_g, gw, prim::transpose(gy, 0, 1), x, what + " weight gradient");
      expect_matmul_close(gb_g, gb, prim::transpose(gy, 0, 1), full({c.rows, 1}, 1.0, dt), what + " bias gradient");
      EXPECT_FALSE(prim::linear_weight_grad(gpu(gy), gpu(x), false).second.defined()) << what;
    }
}

// TF32 (opt in) rounds the inputs to 10 mantissa bits, so each product
// a_ik b_kj is off by up to about 2^-10 of |a_ik b_kj| (2^-11 per input,
// twice that if the hardware truncates): |tf32 - exact| <= 4e-3 (|a| @ |b|).
// Plain f32 stays within 2e-5 (|a| @ |b|), expect_matmul_close's bound, and
// TF32 must break that bound, or it was not used: with K = 256 standard
// normal terms the products' errors add up like a random walk, to about
// sqrt(K) * 3e-4 ~ 5e-3, while 2e-5 (|a| @ |b|) is about 2e-5 * 0.64 K ~
// 3e-3, so some half of the 8192 elements break it (a tenth is asked for).
TEST_F(CudaTensor, Tf32IsOptIn) {
  SCOPED_TRACE(trace());
  const Tensor a = randn({128, 256}, DType::f32), b = randn({256, 64}, DType::f32);
  const auto exact = host_f64(prim::matmul(prim::to(a, DType::f64), prim::to(b, DType::f64)));
  const auto scale = host_f64(prim::matmul(prim::unary(UnaryOp::abs, prim::to(a, DType::f64)),
                                           prim::unary(UnaryOp::abs, prim::to(b, DType::f64))));
  EXPECT_FALSE(cuda::allow_tf32());
  cuda::set_allow_tf32(true);
  const auto fast = host_f64(prim::matmul(gpu(a), gpu(b)));
  cuda::set_allow_tf32(false);
  const auto plain = host_f64(prim::matmul(gpu(a), gpu(b)));
  const double f32_bound = 2 * tolerance(DType::f32), tf32_bound = 4e-3;
  double worst_fast = 0, worst_plain = 0;  // |error| / (|a| @ |b|)
  int64_t beyond_f32 = 0;
  for (size_t i = 0; i < exact.size(); ++i) {
    const double e_fast = std::fabs(fast[i] - exact[i]) / scale[i];
    worst_fast = std::max(worst_fast, e_fast);
    worst_plain = std::max(worst_plain, std::fabs(plain[i] - exact[i]) / scale[i]);
    beyond_f32 += e_fast > f32_bound;
  }
  EXPECT_LE(worst_fast, tf32_bound) << "tf32";
  EXPECT_GT(beyond_f32, static_cast<int64_t>(exact.size() / 10))
      << "TF32 left the product at f32 accuracy (worst " << worst_fast << " of |a| @ |b|): it was not used";
  EXPECT_LE(worst_plain, f32_bound) << "f32 after tf32 is switched off";
}

// ---- random numbers -------------------------------------------------------------

TEST_F(CudaTensor, UniformIsBitIdenticalToTheCpu) {
  for (DType dt : kFloatTypes) {
    for (auto [lo, hi] : {std::pair{0.0, 1.0}, std::pair{-2.0, 3.0}}) {
      Generator cpu_gen(seed_), gpu_gen(seed_);
      cpu_gen.take(5);  // a nonzero offset that is not a multiple of 4 elements
      gpu_gen.take(5);
      Tensor c = mpt::rand({4099}, dt, kCPU, &cpu_gen, lo, hi);
      Tensor g = mpt::rand({4099}, dt, kCuda0, &gpu_gen, lo, hi);
      expect_same_bits(g, c, fmt::format("uniform {} [{}, {}) seed {}", dtype_name(dt), lo, hi, seed_));
      EXPECT_EQ(cpu_gen.offset(), gpu_gen.offset());
    }
  }
}

TEST_F(CudaTensor, NormalMatchesTheCpuAfterRounding) {
  for (DType dt : kFloatTypes) {
    Generator cpu_gen(seed_), gpu_gen(seed_);
    Tensor c = mpt::randn({10007}, dt, kCPU, &cpu_gen);
    Tensor g = mpt::randn({10007}, dt, kCuda0, &gpu_gen);
    const std::string what = fmt::format("normal {} seed {}", dtype_name(dt), seed_);
    if (dt == DType::f16 || dt == DType::bf16) {
      // log/sin/cos differ by an ulp of f64 at most: invisible after rounding to 16 bits.
      expect_same_bits(g, c, what);
    } else if (dt == DType::f32) {
      const auto gv = g.to_vector<float>(), cv = c.to_vector<float>();
      for (size_t i = 0; i < gv.size(); ++i) {
        int32_t gb, cb;
        std::memcpy(&gb, &gv[i], 4);
        std::memcpy(&cb, &cv[i], 4);
        ASSERT_LE(std::abs(gb - cb), 1) << what << " element " << i << ": " << gv[i] << " vs " << cv[i];
      }
    } else {
      expect_close(host_f64(g), host_f64(c), 1e-14, 1e-15, what);
    }
  }
}

// ---- the caching allocator ------------------------------------------------------

TEST_F(CudaTensor, AllocatorReusesFreedBlocksAndCountsBytes) {
  synchronize(kCuda0);
  empty_cache();
  const MemoryStats base = memory_stats(kCuda0);
  EXPECT_EQ(base.reserved_bytes, base.allocated_bytes);
  constexpr uint64_t kBytes = 1 << 20;
  {
    Tensor t = Tensor::empty({kBytes / 4}, DType::f32, kCuda0);
    const MemoryStats s = memory_stats(kCuda0);
    EXPECT_EQ(s.allocated_bytes, base.allocated_bytes + kBytes);
    EXPECT_EQ(s.reserved_bytes, base.reserved_bytes + kBytes);
    EXPECT_EQ(s.num_allocs, base.num_allocs + 1);
    EXPECT_EQ(s.num_device_mallocs, base.num_device_mallocs + 1);
    EXPECT_GE(s.peak_allocated_bytes, s.allocated_bytes);
  }
  const MemoryStats freed = memory_stats(kCuda0);
  EXPECT_EQ(freed.allocated_bytes, base.allocated_bytes);
  EXPECT_EQ(freed.reserved_bytes, base.reserved_bytes + kBytes);  // cached, not returned
  {
    Tensor t = Tensor::empty({kBytes / 4}, DType::f32, kCuda0);
    EXPECT_EQ(memory_stats(kCuda0).num_device_mallocs, freed.num_device_mallocs);  // reused
    EXPECT_EQ(memory_stats(kCuda0).num_allocs, freed.num_allocs + 1);
  }
  // Sizes round up to classes: a slightly smaller request reuses the block too.
  { Tensor t = Tensor::empty({kBytes / 4 - 100}, DType::f32, kCuda0); }
  EXPECT_EQ(memory_stats(kCuda0).num_device_mallocs, freed.num_device_mallocs);

  reset_peak_memory_stats(kCuda0);
  EXPECT_EQ(memory_stats(kCuda0).peak_allocated_bytes, base.allocated_bytes);
  { Tensor t = Tensor::empty({4 * kBytes / 4}, DType::f32, kCuda0); }
  const MemoryStats peak = memory_stats(kCuda0);
  EXPECT_EQ(peak.peak_allocated_bytes, base.allocated_bytes + 4 * kBytes);
  EXPECT_GE(peak.peak_reserved_bytes, peak.reserved_bytes);

  empty_cache();
  const MemoryStats emptied = memory_stats(kCuda0);
  EXPECT_EQ(emptied.reserved_bytes, emptied.allocated_bytes);
  EXPECT_GT(emptied.num_device_frees, peak.num_device_frees);

  // Zero bytes: a valid, usable (empty) tensor.
  Tensor empty = Tensor::empty({0}, DType::f32, kCuda0);
  EXPECT_EQ(prim::to(empty, kCPU).numel(), 0);
}

TEST_F(CudaTensor, OutOfMemoryIsAnExceptionThatNamesTheRequest) {
  const int64_t elements = int64_t(1) << 48;  // 2^50 bytes of f32
  try {
    Tensor t = Tensor::empty({elements}, DType::f32, kCuda0);
    FAIL() << "allocating 1 PiB did not throw";
  } catch (const OutOfMemoryError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("1125899906842624"), std::string::npos) << msg;
    EXPECT_NE(msg.find("cuda:0"), std::string::npos) << msg;
  }
  // The allocator and the device still work.
  Tensor ok = full({1000}, 2.0, DType::f32, kCuda0);
  EXPECT_EQ(prim::sum(ok).item(), 2000.0);
}

TEST_F(CudaTensor, RecordStreamDelaysReuseUntilTheStreamIsDone) {
  const Stream side = Stream::create(kCuda0);
  void* block = nullptr;
  {
    Tensor t = Tensor::empty({1 << 16}, DType::f32, kCuda0);  // on the default stream
    block = t.storage()->data();
    {
      StreamGuard guard(side);
      prim::fill_(t, 1.0);  // used on the side stream
    }
    record_stream(t.data_ptr(), side);
    record_stream(static_cast<char*>(block) + 64, side);  // a view inside the block: same block
  }
  side.synchronize();
  const uint64_t mallocs = memory_stats(kCuda0).num_device_mallocs;
  Tensor again = Tensor::empty({1 << 16}, DType::f32, kCuda0);
  EXPECT_EQ(again.storage()->data(), block);
  EXPECT_EQ(memory_stats(kCuda0).num_device_mallocs, mallocs);

  int host_value = 0;
  EXPECT_THROW(record_stream(&host_value, side), ValueError);
}

// ---- streams and events ---------------------------------------------------------

TEST_F(CudaTensor, WorkOnACreatedStreamAndEvents) {
  SCOPED_TRACE(trace());
  const Stream side = Stream::create(kCuda0, /*priority=*/-1);
  EXPECT_EQ(current_stream(kCuda0), Stream::default_stream(kCuda0));
  Tensor a = randn({256, 128}, DType::f32), b = randn({128, 64}, DType::f32);
  Tensor ga = gpu(a), gb = gpu(b);
  synchronize(kCuda0);

  Event start(kCuda0, /*timing=*/true), stop(kCuda0, /*timing=*/true), done(kCuda0);
  Tensor product;
  {
    StreamGuard guard(side);
    EXPECT_EQ(current_stream(kCuda0), side);
    start.record();
    product = prim::matmul(ga, gb);
    product = prim::unary(UnaryOp::tanh, product);
    stop.record();
    done.record(side);
  }
  EXPECT_EQ(current_stream(kCuda0), Stream::default_stream(kCuda0));
  // The default stream waits for the side stream before reading its result.
  done.wait(current_stream(kCuda0));
  expect_matmul_close(product, prim::unary(UnaryOp::tanh, prim::matmul(a, b)), a, b, "matmul on a side stream");
  stop.synchronize();
  EXPECT_TRUE(stop.query());
  EXPECT_GE(start.elapsed_ms(stop), 0.0f);

  Event cpu_event(kCPU);
  cpu_event.record(current_stream(kCPU));
  EXPECT_TRUE(cpu_event.query());
  EXPECT_THROW(cpu_event.elapsed_ms(cpu_event), ValueError);
}

TEST_F(CudaTensor, UnknownDevicesAreRefusedWithTheCount) {
  const int n = cuda_device_count();
  try {
    check_device_available(Device(DeviceType::cuda, n));
    FAIL() << "cuda:" << n << " was accepted";
  } catch (const DeviceError& e) {
    EXPECT_NE(std::string(e.what()).find(fmt::format("cuda:{} requested, but this machine has {} CUDA device", n, n)),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(Tensor::empty({3}, DType::f32, Device(DeviceType::cuda, n)), DeviceError);
}

// The same draws as the CPU's, bit for bit, with those that round up to
// `high` moved to `low` on both.
TEST_F(CudaTensor, UniformDrawsMatchTheCpuAndStayBelowHigh) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  for (DType dt : {DType::bf16, DType::f16, DType::f32}) {
    SCOPED_TRACE(dtype_name(dt));
    Generator on_cpu(seed), on_gpu(seed);
    const Tensor c = mpt::rand({1 << 20}, dt, kCPU, &on_cpu, 0.0, 1.0);
    const Tensor g = mpt::rand({1 << 20}, dt, kCuda0, &on_gpu, 0.0, 1.0);
    EXPECT_EQ(host_f64(g), host_f64(c));
    EXPECT_LT(prim::amax(g).item(), 1.0);
  }
}

// ---- pinned host memory ------------------------------------------------------------

TEST_F(CudaTensor, PinnedCopiesArriveAndBlocksAreRecycledOnlyAfterTheCopy) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  const Tensor src = mpt::randn({1 << 20}, DType::f32, kCPU, &gen);
  Tensor pinned = pin_memory(src);
  ASSERT_TRUE(is_pinned(pinned));
  EXPECT_FALSE(is_pinned(src));
  EXPECT_TRUE(is_pinned(prim::slice(pinned, 0, 10, 20)));  // views inside the block count
  const void* block = pinned.data_ptr();
  // Queue a long kernel first, so the copy is still pending when the host
  // lets go of the pinned tensor and asks for another of the same size.
  Tensor busy = mpt::randn({1 << 24}, DType::f32, kCuda0, &gen);
  for (int i = 0; i < 20; ++i) busy = prim::unary(UnaryOp::tanh, busy);
  Tensor on_gpu = prim::to(pinned, kCuda0);
  Event copied(kCuda0);
  copied.record(current_stream(kCuda0));
  pinned = Tensor();
  Tensor next = empty_pinned({1 << 20}, DType::f32);
  const bool taken_at_once = next.data_ptr() == block;
  // Reuse is allowed only once the copy is done.
  if (taken_at_once) EXPECT_TRUE(copied.query());
  prim::fill_(next, 0.0);  // would corrupt the copy if the block were shared too early
  EXPECT_EQ(on_gpu.to_vector<float>(), src.to_vector<float>());
  // And once it is done the block is handed out again, not left idle: with
  // `next` held, it is the cache's only free block of this size (no other
  // test in this binary pins memory, and a run repeated in one process makes
  // no third block), so the next request of the size must get it.
  if (!taken_at_once) {
    copied.synchronize();
    const Tensor again = empty_pinned({1 << 20}, DType::f32);
    EXPECT_EQ(static_cast<const void*>(again.data_ptr()), block) << "a free block whose copy is done was not reused";
  }
}

// ---- 64-bit indexing --------------------------------------------------------------

TEST_F(CudaTensor, HandlesMoreThan2To31Elements) {
  const int64_t n = (int64_t(1) << 31) + 40;
  try {
    {
      // Strided copy (a broadcast source): the 64-bit offset path.
      Tensor dst = Tensor::empty({n}, DType::u8, kCuda0);
      prim::copy_(dst, prim::expand(full({1}, 7.0, DType::u8, kCuda0), {n}));
      const auto tail = prim::slice(dst, 0, n - 8, n).to_vector<uint8_t>();
      EXPECT_EQ(tail, std::vector<uint8_t>(8, 7));
    }
    // Contiguous element-wise with packed loads.
    Tensor x = full({n}, 1.5, DType::f16, kCuda0);
    Tensor y = prim::unary(UnaryOp::neg, x);
    EXPECT_EQ(prim::slice(y, 0, n - 3, n).to_vector<float>(), std::vector<float>(3, -1.5f));
    EXPECT_EQ(prim::slice(y, 0, 0, 2).to_vector<float>(), std::vector<float>(2, -1.5f));
    EXPECT_EQ(prim::sum(prim::slice(y, 0, n - 1000, n)).item(), -1500.0);
  } catch (const OutOfMemoryError&) {
    empty_cache();
    GTEST_SKIP() << "skipped: needs about 10 GB of GPU memory";
  }
  empty_cache();
}

// The step timer on a GPU: phases are timing events on the stream, read
// when the breakdown is taken; a phase with no GPU work in it is near zero.
TEST(CudaStepTimer, TimesPhasesWithEventsOnTheStream) {
  MPT_SKIP_WITHOUT_CUDA();
  const Device d("cuda:0");
  StepTimer timer(d);
  const Tensor a = randn({2048, 2048}, DType::f32, d);
  for (int step = 0; step < 3; ++step) {
    timer.begin_step();
    Tensor product = prim::matmul(a, a);
    for (int k = 0; k < 4; ++k) product = prim::matmul(product, a);
    timer.lap(StepPhase::forward);
    timer.lap(StepPhase::backward);  // nothing queued in between
    timer.end_step();
  }
  const StepBreakdown b = timer.take();
  EXPECT_EQ(b.steps, 3);
  EXPECT_GT(b[StepPhase::forward], 0.0);
  EXPECT_LT(b[StepPhase::backward], b[StepPhase::forward]);
  EXPECT_EQ(timer.take().steps, 0);
}

// index_add_rows_ (embedding's backward) adds each row's terms in one fixed
// order: the same bits every run (atomics added in whatever order threads
// came), and the f64 sum up to the table dtype's rounding. One row takes
// most indices, so its terms cross many chunks of the sorted list; the
// others take a few or none; the table holds values already; the lengths
// fall on and off the chunk size.
TEST_F(CudaTensor, IndexAddRowsGivesTheSameBitsEveryRun) {
  SCOPED_TRACE(trace());
  std::mt19937_64 rng(seed_);
  const int64_t rows = 13, d = 70;
  for (const int64_t n : {int64_t{1}, int64_t{31}, int64_t{64}, int64_t{1000}, int64_t{20000}}) {
    std::vector<int64_t> ids(static_cast<size_t>(n));
    for (int64_t& id : ids) id = rng() % 10 < 7 ? 0 : static_cast<int64_t>(rng() % rows);
    const Tensor idx = gpu(from_vector(ids, {n}, DType::i64));
    for (const DType dt : {DType::f32, DType::f64, DType::f16, DType::bf16}) {
      SCOPED_TRACE(fmt::format("n {} {}", n, dtype_name(dt)));
      // Terms of many magnitudes (e^-8 to e^8 apart), so that the order of
      // additions shows in the rounding; over sqrt(n), so that f16's sums
      // stay far from its largest value.
      const Tensor magnitude = prim::mul_scalar(prim::unary(UnaryOp::exp, prim::mul_scalar(randn({n, 1}, DType::f32), 2.0)),
                                                1.0 / std::sqrt(static_cast<double>(n)));
      const Tensor src = prim::to(prim::mul(randn({n, d}, DType::f32), magnitude), dt);
      const Tensor base = randn({rows, d}, dt);
      auto add_on_gpu = [&] {
        const Tensor table = gpu(base);
        prim::index_add_rows_(table, idx, gpu(src));
        return host_f64(table);
      };
      const std::vector<double> first = add_on_gpu();
      for (int run = 0; run < 4; ++run) ASSERT_EQ(add_on_gpu(), first) << "run " << run + 1;
      const Tensor expected = prim::to(base, DType::f64);
      prim::index_add_rows_(expected, from_vector(ids, {n}, DType::i64), prim::to(src, DType::f64));
      const double tol = dt == DType::f64 ? 1e-12 : dt == DType::f32 ? 1e-4 : 2 * tolerance(dt);
      EXPECT_LE(testing::rel_error(first, host_f64(expected)), tol);
    }
  }
}

}  // namespace
}  // namespace mpt
