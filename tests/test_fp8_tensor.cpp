// e4m3 and e5m2 tensors on the CPU: casts from and to every dtype agree
// with the scalar conversions of tensor/fp8.h element by element, data
// movement keeps the bits, and every op that would compute on float8 (or
// convert it silently to compute) is a DTypeError naming the op and dtype.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "autograd/ops.h"
#include "models/sgd.h"
#include "tensor/ops.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

using testing::error_of;
using testing::expect_contains;

constexpr DType kFloat8[] = {DType::e4m3, DType::e5m2};

Fp8Format format_of(DType t) { return t == DType::e4m3 ? Fp8Format::e4m3 : Fp8Format::e5m2; }

std::vector<uint8_t> codes_of(const Tensor& t) {
  const Tensor c = prim::contiguous(t);
  const auto* p = static_cast<const uint8_t*>(c.data_ptr());
  return std::vector<uint8_t>(p, p + c.numel());
}

// A tensor holding the given codes.
Tensor from_codes(const std::vector<uint8_t>& codes, DType t) {
  Tensor out = Tensor::empty({static_cast<int64_t>(codes.size())}, t);
  std::memcpy(out.data_ptr(), codes.data(), codes.size());
  return out;
}

std::vector<uint8_t> all_codes() {
  std::vector<uint8_t> c(256);
  for (int i = 0; i < 256; ++i) c[i] = static_cast<uint8_t>(i);
  return c;
}

TEST(Float8DType, NamesSizesAndKind) {
  EXPECT_EQ(dtype_from_name("e4m3"), DType::e4m3);
  EXPECT_EQ(dtype_from_name("float8_e4m3fn"), DType::e4m3);
  EXPECT_EQ(dtype_from_name("e5m2"), DType::e5m2);
  EXPECT_EQ(dtype_from_name("float8_e5m2"), DType::e5m2);
  EXPECT_STREQ(dtype_name(DType::e4m3), "e4m3");
  EXPECT_STREQ(dtype_name(DType::e5m2), "e5m2");
  expect_contains(error_of<DTypeError>([] { dtype_from_name("fp8"); }), {"e4m3", "e5m2"});
  for (DType t : kFloat8) {
    EXPECT_EQ(dtype_size(t), 1u);
    EXPECT_TRUE(is_floating(t));
    EXPECT_TRUE(is_float8(t));
    EXPECT_NE(std::find(std::begin(kAllDTypes), std::end(kAllDTypes), t), std::end(kAllDTypes));
  }
  EXPECT_FALSE(is_float8(DType::f16));
  EXPECT_FALSE(is_float8(DType::u8));
}

// As in PyTorch, float8 promotes with nothing but itself.
TEST(Float8DType, PromotionIsRefused) {
  EXPECT_EQ(promote(DType::e4m3, DType::e4m3), DType::e4m3);
  for (DType t : kFloat8)
    for (DType other : kAllDTypes) {
      if (other == t) continue;
      expect_contains(error_of<DTypeError>([&] { promote(t, other); }), {"promote", dtype_name(t), dtype_name(other)});
      EXPECT_THROW(promote(other, t), DTypeError);
    }
}

// Floats of every magnitude the formats care about, and the specials.
std::vector<float> probe_floats(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<float> v;
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> exponent(-20, 18);
  for (int i = 0; i < 20000; ++i) v.push_back(std::ldexp(normal(rng), exponent(rng)));
  for (int i = 0; i < 20000; ++i) v.push_back(bits_float(static_cast<uint32_t>(rng())));  // any bits, NaN too
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {0.0f, -0.0f, inf, -inf, std::nanf(""), -std::nanf(""), 448.0f, 464.0f, 465.0f, 480.0f, 57344.0f,
                  61440.0f, -61439.0f, 0x1p-9f, 0x1p-10f, 0x1p-16f, 0x1p-17f, 1e-30f, -1e30f})
    v.push_back(x);
  return v;
}

TEST(Float8Tensor, CastsFromF32MatchTheScalarConversion) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const std::vector<float> v = probe_floats(seed);
  const auto n = static_cast<int64_t>(v.size());
  const Tensor x = from_vector(v, {n});
  // The same values every other element of a wider block: the strided loop.
  const Tensor pairs = prim::contiguous(prim::expand(prim::view(x, {n, 1}), {n, 2}));
  const Tensor xt = prim::slice(pairs, 1, 1, 2);
  for (DType t : kFloat8) {
    const std::vector<uint8_t> got = codes_of(prim::to(x, t));
    ASSERT_EQ(codes_of(prim::to(xt, t)), got) << dtype_name(t) << " strided";
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(got[i], float_to_fp8_bits(v[i], format_of(t))) << dtype_name(t) << " of " << v[i];
    // And back, every bit (NaN decodes to 0x7FFFE000 on both devices).
    const std::vector<float> back = prim::to(from_codes(got, t), DType::f32).to_vector<float>();
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(float_bits(back[i]), float_bits(fp8_bits_to_float(got[i], format_of(t)))) << dtype_name(t);
  }
}

// Every code to every dtype: the float types exactly as the scalar value
// converts, the integers truncated from it (only the codes whose values
// they hold: converting NaN, infinity or a value out of range is undefined).
TEST(Float8Tensor, EveryCodeCastsToEveryDType) {
  for (DType from : kFloat8) {
    const Tensor codes = from_codes(all_codes(), from);
    for (DType to : kAllDTypes) {
      std::vector<uint8_t> held;
      for (uint8_t c : all_codes()) {
        const float v = fp8_bits_to_float(c, format_of(from));
        if (is_floating(to) || (to == DType::u8 ? v > -1 && v < 256 : std::isfinite(v))) held.push_back(c);
      }
      const std::vector<double> got = prim::to(from_codes(held, from), to).to_vector<double>();
      for (size_t i = 0; i < held.size(); ++i) {
        const float v = fp8_bits_to_float(held[i], format_of(from));
        const std::string what = fmt::format("{} code {} -> {}", dtype_name(from), int(held[i]), dtype_name(to));
        double want = v;
        if (to == DType::f16) want = float(Half(v));
        if (to == DType::bf16) want = float(BFloat16(v));
        if (is_float8(to)) want = fp8_bits_to_float(float_to_fp8_bits(v, format_of(to)), format_of(to));
        if (!is_floating(to)) want = std::trunc(v) + 0.0;  // (an integer has no -0)
        if (std::isnan(want)) {
          ASSERT_TRUE(std::isnan(got[i])) << what;
          continue;
        }
        ASSERT_EQ(got[i], want) << what;
        ASSERT_EQ(std::signbit(got[i]), std::signbit(want)) << what;
      }
    }
    // Into the other float8 format, every bit, NaN included.
    const DType other = from == DType::e4m3 ? DType::e5m2 : DType::e4m3;
    const std::vector<uint8_t> crossed = codes_of(prim::to(codes, other));
    for (int c = 0; c < 256; ++c)
      ASSERT_EQ(crossed[c], float_to_fp8_bits(fp8_bits_to_float(static_cast<uint8_t>(c), format_of(from)),
                                              format_of(other)));
  }
}

// From f16, bf16 (every pattern), f64 and the integers: one rounding of the
// source's value.
TEST(Float8Tensor, CastsFromOtherDTypesRoundOnce) {
  std::vector<Half> halves;
  std::vector<BFloat16> bf16s;
  for (uint32_t b = 0; b < 0x10000; ++b) {
    halves.push_back(Half::from_bits(static_cast<uint16_t>(b)));
    bf16s.push_back(BFloat16::from_bits(static_cast<uint16_t>(b)));
  }
  const Tensor th = from_vector(halves, {0x10000}, DType::f16);
  const Tensor tb = from_vector(bf16s, {0x10000}, DType::bf16);
  std::vector<double> doubles = {1.0 + 0x1p-4 + 0x1p-40, -(1.0 + 0x1p-3 + 0x1p-40), 464.0000001, 1e300, -1e-300};
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> wide(-70000, 70000);
  for (int i = 0; i < 10000; ++i) doubles.push_back(wide(rng));
  const Tensor td = from_vector(doubles, {static_cast<int64_t>(doubles.size())}, DType::f64);
  const std::vector<int64_t> ints = {0, 1, -1, 17, 300, 448, 449, 465, 60000, 61440, -1000000, int64_t{1} << 40};
  const Tensor ti = from_vector(ints, {static_cast<int64_t>(ints.size())}, DType::i64);
  for (DType t : kFloat8) {
    const Fp8Format f = format_of(t);
    const std::vector<uint8_t> from_h = codes_of(prim::to(th, t)), from_b = codes_of(prim::to(tb, t));
    for (uint32_t b = 0; b < 0x10000; ++b) {
      ASSERT_EQ(from_h[b], half_bits_to_fp8_bits(static_cast<uint16_t>(b), f)) << dtype_name(t) << " f16 " << b;
      ASSERT_EQ(from_b[b], bf16_bits_to_fp8_bits(static_cast<uint16_t>(b), f)) << dtype_name(t) << " bf16 " << b;
    }
    const std::vector<uint8_t> from_d = codes_of(prim::to(td, t));
    for (size_t i = 0; i < doubles.size(); ++i)
      ASSERT_EQ(from_d[i], double_to_fp8_bits(doubles[i], f)) << dtype_name(t) << " of " << doubles[i];
    const std::vector<uint8_t> from_i = codes_of(prim::to(ti, t));
    const std::vector<uint8_t> from_i32 = codes_of(prim::to(prim::to(prim::slice(ti, 0, 0, 11), DType::i32), t));
    for (size_t i = 0; i < ints.size(); ++i) {
      ASSERT_EQ(from_i[i], double_to_fp8_bits(static_cast<double>(ints[i]), f)) << dtype_name(t) << " " << ints[i];
      if (i < 11) ASSERT_EQ(from_i32[i], from_i[i]);
    }
  }
  EXPECT_EQ(codes_of(prim::to(td, DType::e4m3))[0], 0x39);  // just above a midpoint: up, not to even
}

TEST(Float8Tensor, DataMovementKeepsTheBits) {
  for (DType t : kFloat8) {
    const std::vector<uint8_t> codes = all_codes();
    const Tensor x = prim::view(from_codes(codes, t), {16, 16});
    EXPECT_EQ(codes_of(prim::clone(x)), codes);
    const Tensor xt = prim::contiguous(prim::transpose(x, 0, 1));
    for (int r = 0; r < 16; ++r)
      for (int c = 0; c < 16; ++c) ASSERT_EQ(codes_of(xt)[r * 16 + c], codes[c * 16 + r]);
    const Tensor joined = prim::cat({prim::slice(x, 0, 0, 3), prim::slice(x, 0, 3, 16)}, 0);
    EXPECT_EQ(codes_of(joined), codes);
    const Tensor rows = prim::index_select_rows(x, from_vector(std::vector<int64_t>{15, 0, 7}, {3}, DType::i64));
    const std::vector<uint8_t> picked = codes_of(rows);
    for (int c = 0; c < 16; ++c) {
      EXPECT_EQ(picked[c], codes[15 * 16 + c]);
      EXPECT_EQ(picked[32 + c], codes[7 * 16 + c]);
    }
    Tensor y = zeros({4}, t);
    prim::copy_(y, from_codes({1, 2, 3, 4}, t));
    EXPECT_EQ(codes_of(y), (std::vector<uint8_t>{1, 2, 3, 4}));
    // Fills and factories round the value as a cast does.
    EXPECT_EQ(codes_of(full({2}, 1.0, t)), std::vector<uint8_t>(2, float_to_fp8_bits(1.0f, format_of(t))));
    EXPECT_EQ(codes_of(full({1}, 1e6, t))[0], t == DType::e4m3 ? 0x7F : 0x7C);  // not saturated
    EXPECT_EQ(codes_of(ones({1}, t))[0], t == DType::e4m3 ? 0x38 : 0x3C);
    EXPECT_EQ(codes_of(zeros({3}, t)), std::vector<uint8_t>(3, 0));
    EXPECT_EQ(scalar_tensor(-2.0, t).item(), -2.0);
    if (t == DType::e4m3) EXPECT_EQ(x.data<Float8E4M3>()[1].bits, 1);
    else EXPECT_THROW(x.data<Float8E4M3>(), DTypeError);
  }
  const std::vector<Float8E5M2> values = {Float8E5M2(1.5f), Float8E5M2(-0.25f)};
  EXPECT_EQ(from_vector(values, {2}, DType::e5m2).to_vector<float>(), (std::vector<float>{1.5f, -0.25f}));
  EXPECT_EQ(from_vector(values, {2}, DType::e4m3).to_vector<Float8E4M3>()[1].bits, 0xA8);  // -0.25 in e4m3
  const std::string printed = from_codes({0x38, 0xC0, 0x7F}, DType::e4m3).str();
  expect_contains(printed, {"1", "-2", "nan", "dtype=e4m3"});
}

// Each case: the op's name as its message gives it, and a call handing it
// float8 (an e4m3 tensor unless the case says otherwise).
struct Refusal {
  std::string op;
  std::function<void(DType)> call;
};

std::vector<Refusal> refusals() {
  const auto f8 = [](DType t, const Shape& s) { return prim::to(full(s, 0.5), t); };
  // (The calls capture f8 by value: they outlive this function's frame.)
  return {
      {"add", [=](DType t) { prim::add(f8(t, {4}), f8(t, {4})); }},
      {"add", [=](DType t) { prim::add(f8(t, {4}), ones({4})); }},
      {"mul", [=](DType t) { prim::mul(ones({4}, DType::f16), f8(t, {4})); }},
      {"sub", [=](DType t) { prim::binary_(BinaryOp::sub, zeros({4}), ones({4}), f8(t, {4})); }},
      {"relu", [=](DType t) { prim::unary(UnaryOp::relu, f8(t, {4})); }},
      {"affine", [=](DType t) { prim::mul_scalar(f8(t, {4}), 2.0); }},
      {"sum", [=](DType t) { prim::sum(f8(t, {4})); }},
      {"amax", [=](DType t) { prim::amax(f8(t, {4})); }},
      {"argmax", [=](DType t) { prim::argmax(f8(t, {2, 4}), 1); }},
      {"matmul", [=](DType t) { prim::matmul(f8(t, {2, 3}), f8(t, {3, 2})); }},
      {"linear", [=](DType t) { prim::linear(f8(t, {2, 3}), f8(t, {4, 3}), Tensor()); }},
      {"linear_weight_grad", [=](DType t) { prim::linear_weight_grad(f8(t, {2, 3}), f8(t, {2, 4}), true); }},
      {"conv2d", [=](DType t) { prim::conv2d(f8(t, {1, 1, 3, 3}), f8(t, {1, 1, 2, 2}), {}); }},
      {"max_pool2d", [=](DType t) { prim::max_pool2d(f8(t, {1, 1, 4, 4}), {}); }},
      {"index_add_rows_",
       [=](DType t) { prim::index_add_rows_(f8(t, {3, 2}), zeros({1}, DType::i64), f8(t, {1, 2})); }},
      {"scaled_copy_list_", [=](DType t) { prim::scaled_copy_list_({zeros({4})}, {f8(t, {4})}, 2.0); }},
      {"scaled_copy_list_", [=](DType t) { prim::scaled_copy_list_({f8(t, {4})}, {ones({4})}, 2.0); }},
      {"randn", [=](DType t) { randn({4}, t); }},
      {"rand", [=](DType t) { rand({4}, t); }},
      // Autograd ops, among them those that would widen to f32 first.
      {"softmax", [=](DType t) { softmax(f8(t, {2, 3}), 1); }},
      {"log_softmax", [=](DType t) { log_softmax(f8(t, {2, 3}), 1); }},
      {"cross_entropy", [=](DType t) { cross_entropy(f8(t, {2, 3}), zeros({2}, DType::i64)); }},
      {"mse_loss", [=](DType t) { mse_loss(f8(t, {3}), ones({3})); }},
      {"layer_norm", [=](DType t) { layer_norm(f8(t, {2, 3}), Tensor(), Tensor()); }},
      {"layer_norm", [=](DType t) { layer_norm(ones({2, 3}), f8(t, {3}), Tensor()); }},
      {"layer_norm", [=](DType t) { layer_norm(ones({2, 3}), Tensor(), Tensor(), 1e-5, t); }},
      {"dropout", [=](DType t) { dropout(f8(t, {4}), 0.5); }},
      {"silu", [=](DType t) { silu(f8(t, {4})); }},
      {"gelu", [=](DType t) { gelu(f8(t, {4})); }},
      {"batch_norm", [=](DType t) { batch_norm(f8(t, {2, 3}), Tensor(), Tensor(), Tensor(), Tensor(), true); }},
      {"scaled_dot_product_attention",
       [=](DType t) { scaled_dot_product_attention(f8(t, {1, 1, 2, 4}), f8(t, {1, 1, 2, 4}), f8(t, {1, 1, 2, 4})); }},
      {"scaled_dot_product_attention",
       [=](DType t) {
         scaled_dot_product_attention(ones({1, 1, 2, 4}), ones({1, 1, 2, 4}), ones({1, 1, 2, 4}), false, std::nullopt,
                                      f8(t, {2, 2}));
       }},
      {"SGD", [=](DType t) { optim::SGD({f8(t, {4})}); }},
      {"GradScaler::scale", [=](DType t) { amp::GradScaler().scale(f8(t, {})); }},
  };
}

TEST(Float8Tensor, ArithmeticIsRefusedNamingTheOpAndDType) {
  for (DType t : kFloat8)
    for (const Refusal& r : refusals()) {
      SCOPED_TRACE(r.op + " " + dtype_name(t));
      expect_contains(error_of<DTypeError>([&] { r.call(t); }), {r.op, dtype_name(t)});
    }
}

// Autocast re-types f32, f16 and bf16 only: a float8 input reaches the op
// as it is, and the op refuses it (cat, which promotes under autocast,
// refuses mixed dtypes).
TEST(Float8Tensor, AutocastLeavesFloat8ForTheOpToRefuse) {
  amp::AutocastGuard autocast(DeviceType::cpu, DType::bf16);
  const Tensor x = prim::to(ones({2, 2}), DType::e4m3);
  expect_contains(error_of<DTypeError>([&] { matmul(x, ones({2, 2})); }), {"matmul", "e4m3"});
  expect_contains(error_of<DTypeError>([&] { cat({x, ones({2, 2})}, 0); }), {"cat", "e4m3"});
  EXPECT_EQ(cat({x, x}, 0).dtype(), DType::e4m3);
}

}  // namespace
}  // namespace mpt
