// FP8 on the CPU: the quantizing op against tensor/fp8.h's scalar
// conversions, the scaled FP8 product and the FP8 linear layer (forward and
// backward) against an f64 reference of the same quantized math, the
// recipes' state (delayed updates against the written rule, checkpoint
// round trip) and the errors for what FP8 cannot take.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "amp/fp8_linear.h"
#include "amp/fp8_scaling.h"
#include "amp/fp8_stats.h"
#include "autograd/engine.h"
#include "autograd/ops.h"
#include "models/adamw.h"
#include "models/gpt.h"
#include "tensor/fp8.h"
#include "tensor/ops.h"
#include "tests/fp8_mlp_run.h"
#include "tests/fp8_test_values.h"
#include "tests/test_util.h"
#include "train/mixed_precision.h"

namespace mpt {
namespace {

using amp::Fp8Group;
using testing::error_of;
using testing::expect_contains;
using testing::fresh_seed;
using testing::random_codes;
using testing::spread_values;

Fp8Format format_of(DType t) { return testing::fp8_format_of(t); }
std::vector<uint8_t> codes_of(const Tensor& t) { return testing::bytes_of(t); }

float scalar(const Tensor& t) { return prim::to(t, DType::f32).to_vector<float>()[0]; }

TEST(Fp8Ops, QuantizeIsTheScalarSaturatingConversionOfEachScaledElement) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  std::mt19937_64 rng(seed);
  for (DType in_dtype : {DType::f32, DType::bf16, DType::f16})
    for (DType format : {DType::e4m3, DType::e5m2})
      for (auto [rows, cols] : {std::pair<int64_t, int64_t>{48, 32}, {5, 7}, {1, 1}}) {
        SCOPED_TRACE(fmt::format("{} -> {}, [{}, {}]", dtype_name(in_dtype), dtype_name(format), rows, cols));
        const Tensor in = prim::to(from_vector(spread_values(rows * cols, rng, true), {rows, cols}), in_dtype);
        const float s = std::ldexp(1.0f, static_cast<int>(rng() % 12) - 6) * 1.37f;
        const Tensor scale = from_vector(std::vector<float>{s}, {1});
        const Tensor amax = from_vector(std::vector<float>{0.25f}, {1});
        const prim::Fp8Quantized q = prim::quantize_fp8(in, format, scale, amax, true);
        ASSERT_EQ(q.data.dtype(), format);
        ASSERT_EQ(q.data_t.shape(), (Shape{cols, rows}));
        const std::vector<float> x = prim::to(in, DType::f32).to_vector<float>();
        const std::vector<uint8_t> codes = codes_of(q.data), codes_t = codes_of(q.data_t);
        float expected_amax = 0.25f;
        bool nan = false;
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) {
            const float v = x[r * cols + c];
            const uint8_t want = float_to_fp8_bits(v * s, format_of(format), Fp8Saturation::finite);
            ASSERT_EQ(codes[r * cols + c], want) << "element " << r << ", " << c << " = " << v;
            ASSERT_EQ(codes_t[c * rows + r], want);
            expected_amax = std::max(expected_amax, std::fabs(v));
            nan |= std::isnan(v);
          }
        if (nan) EXPECT_TRUE(std::isnan(scalar(amax)));
        else EXPECT_EQ(scalar(amax), expected_amax);
        EXPECT_EQ(scalar(q.scale_inv), 1.0f / s);
      }
}

TEST(Fp8Ops, AmaxBecomesNanWhereTheTensorHoldsOne) {
  const Tensor in = from_vector(std::vector<float>{1.0f, -3.0f, NAN, 2.0f}, {2, 2});
  const Tensor amax = from_vector(std::vector<float>{5.0f}, {1});
  prim::amax_into(amax, in);
  EXPECT_TRUE(std::isnan(scalar(amax)));
  const Tensor amax2 = from_vector(std::vector<float>{5.0f}, {1});
  prim::amax_into(amax2, from_vector(std::vector<float>{1.0f, -7.5f}, {2}));
  EXPECT_EQ(scalar(amax2), 7.5f);
  // A NaN input quantizes to the NaN code, which saturation leaves alone.
  const prim::Fp8Quantized q = prim::quantize_fp8(in, DType::e4m3, from_vector(std::vector<float>{1.0f}, {1}),
                                                  Tensor(), false);
  EXPECT_EQ(codes_of(q.data)[2] & 0x7F, 0x7F);
}

std::vector<double> decoded(const Tensor& t) {
  std::vector<double> v;
  for (uint8_t c : codes_of(t)) v.push_back(fp8_bits_to_float(c, format_of(t.dtype())));
  return v;
}

TEST(Fp8Ops, GemmIsTheScaledProductOfTheDecodedValues) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  std::mt19937_64 rng(seed);
  const int64_t m = 32, n = 48, k = 64;
  for (auto [fa, fb] : {std::pair{DType::e4m3, DType::e4m3}, {DType::e5m2, DType::e4m3}, {DType::e4m3, DType::e5m2}})
    for (DType out_dtype : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(fmt::format("{} x {} -> {}", dtype_name(fa), dtype_name(fb), dtype_name(out_dtype)));
      const Tensor a = random_codes(m, k, fa, rng), b = random_codes(n, k, fb, rng);
      const float sa = 0.0625f * 1.1f, sb = 3.0f;
      std::vector<float> bias_values(n);
      for (auto& v : bias_values) v = static_cast<float>(static_cast<int>(rng() % 200) - 100) / 7.0f;
      const Tensor bias = prim::to(from_vector(bias_values, {n}), out_dtype);
      const Tensor out = prim::gemm_fp8(a, from_vector(std::vector<float>{sa}, {1}), b,
                                        from_vector(std::vector<float>{sb}, {1}), bias, out_dtype, false);
      ASSERT_EQ(out.shape(), (Shape{m, n}));
      ASSERT_EQ(out.dtype(), out_dtype);
      const std::vector<double> da = decoded(a), db = decoded(b), got = out.to_vector<double>(),
                                bias64 = bias.to_vector<double>();
      std::vector<double> want(m * n);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          double acc = 0;
          for (int64_t p = 0; p < k; ++p) acc += da[i * k + p] * db[j * k + p];
          want[i * n + j] = acc * static_cast<double>(sa) * static_cast<double>(sb) + bias64[j];
        }
      EXPECT_LT(testing::rel_error(got, want), out_dtype == DType::f32 ? 1e-6 : 4e-3);
    }
}

TEST(Fp8Ops, ProductsRefuseWhatFp8CannotTake) {
  std::mt19937_64 rng(1);
  const Tensor one = from_vector(std::vector<float>{1.0f}, {1});
  const Tensor a = random_codes(8, 32, DType::e4m3, rng), b = random_codes(16, 32, DType::e4m3, rng);
  expect_contains(error_of<ShapeError>([&] { prim::gemm_fp8(a, one, b, one, Tensor(), DType::bf16, false); }),
                  {"gemm_fp8", "multiple of 16", "m 8"});
  const Tensor a5 = random_codes(16, 32, DType::e5m2, rng), b5 = random_codes(16, 32, DType::e5m2, rng);
  expect_contains(error_of<DTypeError>([&] { prim::gemm_fp8(a5, one, b5, one, Tensor(), DType::bf16, false); }),
                  {"gemm_fp8", "not both e5m2"});
  const Tensor f = zeros({16, 32});
  expect_contains(error_of<DTypeError>([&] { prim::gemm_fp8(f, one, b, one, Tensor(), DType::bf16, false); }),
                  {"gemm_fp8", "float8"});
  expect_contains(error_of<DTypeError>([&] { prim::quantize_fp8(f, DType::bf16, one, Tensor(), false); }),
                  {"quantize_fp8", "float8"});
  expect_contains(error_of<DTypeError>([&] { prim::quantize_fp8(f, DType::e4m3, zeros({1}, DType::f64), Tensor(), false); }),
                  {"quantize_fp8", "scale"});
}

// The f64 reference of what a quantized tensor stands for: each element
// rounded to the format at `scale`, then divided by it again.
std::vector<double> quantized_values(const std::vector<float>& x, float scale, DType format) {
  std::vector<double> v;
  for (float e : x)
    v.push_back(static_cast<double>(fp8_bits_to_float(float_to_fp8_bits(e * scale, format_of(format),
                                                                        Fp8Saturation::finite),
                                                     format_of(format))) /
                static_cast<double>(scale));
  return v;
}

float amax_of(const std::vector<float>& x) {
  float m = 0;
  for (float e : x) m = std::max(m, std::fabs(e));
  return m;
}

// With and without the ReLU (in the product's epilogue forward, folded
// into the gradient's quantization backward).
TEST(Fp8Linear, ForwardAndBackwardAreTheQuantizedMathWithCurrentScaling) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  std::mt19937_64 rng(seed);
  for (bool relu : {false, true}) {
    SCOPED_TRACE(relu ? "relu" : "no relu");
    const int64_t rows = 32, in = 48, out = 16;
    auto scaling = std::make_shared<amp::Fp8Scaling>(amp::Fp8Recipe{amp::Fp8ScalingMode::current}, kCPU);
    amp::Fp8LinearState state = amp::Fp8LinearState::for_layer(scaling);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    auto randoms = [&](size_t n, float s) {
      std::vector<float> v(n);
      for (auto& e : v) e = normal(rng) * s;
      return v;
    };
    const std::vector<float> xv = randoms(rows * in, 3.0f), wv = randoms(out * in, 0.1f), bv = randoms(out, 0.5f),
                             gv = randoms(rows * out, 1e-3f);
    Tensor x = from_vector(xv, {2, rows / 2, in}).set_requires_grad(true);
    Tensor w = from_vector(wv, {out, in}).set_requires_grad(true);
    Tensor b = from_vector(bv, {out}).set_requires_grad(true);
    const Tensor y = amp::fp8_linear(x, w, b, state, DType::bf16, relu);
    ASSERT_EQ(y.shape(), (Shape{2, rows / 2, out}));
    ASSERT_EQ(y.dtype(), DType::bf16);
    // The loss sum(y * G): y's gradient is G, rounded to bf16 on its way to y.
    backward(sum(mul(to(y, DType::f32), from_vector(gv, {2, rows / 2, out}))));

    const float sx = 448.0f / amax_of(xv), sw = 448.0f / amax_of(wv);
    const std::vector<double> xq = quantized_values(xv, sx, DType::e4m3), wq = quantized_values(wv, sw, DType::e4m3);
    // The ReLU's backward masks the gradient where the output is not
    // positive; current scaling measures what it quantizes: the masked
    // gradient.
    const std::vector<double> y_got = y.to_vector<double>();
    std::vector<float> g16, g16_masked;
    for (size_t i = 0; i < gv.size(); ++i) {
      g16.push_back(static_cast<float>(BFloat16(gv[i])));
      g16_masked.push_back(relu && !(y_got[i] > 0) ? 0.0f : g16.back());
    }
    const float sg = 57344.0f / amax_of(g16_masked);
    const std::vector<double> gq = quantized_values(g16_masked, sg, DType::e5m2);
    std::vector<double> y_ref(rows * out), gx_ref(rows * in, 0.0), gw_ref(out * in, 0.0), gb_ref(out, 0.0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < out; ++o) {
        double acc = static_cast<float>(BFloat16(bv[o]));
        for (int64_t i = 0; i < in; ++i) acc += xq[r * in + i] * wq[o * in + i];
        y_ref[r * out + o] = relu ? std::max(acc, 0.0) : acc;
        for (int64_t i = 0; i < in; ++i) {
          gx_ref[r * in + i] += gq[r * out + o] * wq[o * in + i];
          gw_ref[o * in + i] += gq[r * out + o] * xq[r * in + i];
        }
        gb_ref[o] += g16_masked[r * out + o];
      }
    EXPECT_LT(testing::rel_error(y_got, y_ref), 4e-3);                           // bf16 output
    EXPECT_LT(testing::rel_error(x.grad().to_vector<double>(), gx_ref), 4e-3);  // bf16 product, then f32
    EXPECT_LT(testing::rel_error(w.grad().to_vector<double>(), gw_ref), 1e-5);  // f32 product
    EXPECT_LT(testing::rel_error(b.grad().to_vector<double>(), gb_ref), 1e-5);  // f32 sums
    EXPECT_EQ(x.grad().dtype(), DType::f32);
    EXPECT_EQ(w.grad().dtype(), DType::f32);
    // The scales the current recipe used, kept in the slots.
    const std::vector<float> forward_scales = scaling->scale(Fp8Group::forward).to_vector<float>();
    EXPECT_EQ(forward_scales[state.input_slot], sx);
    EXPECT_EQ(forward_scales[state.weight_slot], sw);
    EXPECT_EQ(scaling->scale(Fp8Group::backward).to_vector<float>()[state.grad_slot], sg);
  }
}

TEST(Fp8Linear, TheWeightIsQuantizedOncePerChangeOfTheWeight) {
  auto scaling = std::make_shared<amp::Fp8Scaling>(amp::Fp8Recipe{}, kCPU);
  amp::Fp8LinearState state = amp::Fp8LinearState::for_layer(scaling);
  const Tensor w = full({16, 16}, 0.5);
  const Tensor x = full({16, 16}, 1.0);
  amp::fp8_linear(x, w, Tensor(), state, DType::bf16);
  const Tensor first = state.weight_fp8;
  amp::fp8_linear(x, w, Tensor(), state, DType::bf16);
  EXPECT_TRUE(state.weight_fp8.is_same(first)) << "an unchanged weight was quantized again";
  prim::fill_(w, 0.25);
  w.bump_version();
  amp::fp8_linear(x, w, Tensor(), state, DType::bf16);
  EXPECT_FALSE(state.weight_fp8.is_same(first));
  EXPECT_EQ(prim::to(state.weight_fp8, DType::f32).to_vector<float>()[0], 0.25f);
}

// A weight made where a freed one was (the same address, version 0 again:
// what a fresh clone each step often gets) has copies of its own: the
// layer does not take it for the weight its copies were made from. Weights
// are made and freed until one lands at a freed one's address (where
// malloc never reuses one, every round still checks the product).
TEST(Fp8Linear, ANewWeightWhereAFreedOneWasGetsCopiesOfItsOwn) {
  auto scaling = std::make_shared<amp::Fp8Scaling>(amp::Fp8Recipe{}, kCPU);
  amp::Fp8LinearState state = amp::Fp8LinearState::for_layer(scaling);
  const Tensor x = full({16, 32}, 0.5);
  const void* freed = nullptr;  // the last round's weight's storage
  int reused = 0;
  for (int round = 1; round <= 64 && reused < 4; ++round) {
    const double value = round % 2 ? 1.0 : 2.0;
    const Tensor w = full({16, 32}, value);
    reused += w.storage().get() == freed;
    freed = w.storage().get();
    // 32 products of 0.5 and the weight, all exact in E4M3 and bf16.
    EXPECT_EQ(amp::fp8_linear(x, w, Tensor(), state, DType::bf16).to_vector<double>(),
              std::vector<double>(16 * 16, 16.0 * value))
        << "round " << round << (reused ? ", after a weight at a freed one's address" : "");
  }
}

TEST(Fp8Linear, ShapesFp8CannotTakeRunInBf16) {
  auto scaling = std::make_shared<amp::Fp8Scaling>(amp::Fp8Recipe{}, kCPU);
  amp::Fp8LinearState state = amp::Fp8LinearState::for_layer(scaling);
  std::mt19937_64 rng(7);
  const Tensor x = from_vector(spread_values(10 * 16, rng, false), {10, 16});  // 10 rows: not a multiple of 16
  const Tensor w = from_vector(spread_values(16 * 16, rng, false), {16, 16});
  const Tensor y = amp::fp8_linear(x, w, Tensor(), state, DType::bf16);
  EXPECT_TRUE(state.warned);
  const Tensor plain = linear(prim::to(x, DType::bf16), prim::to(w, DType::bf16));
  EXPECT_EQ(y.to_vector<float>(), plain.to_vector<float>());
  EXPECT_EQ(scaling->amax(Fp8Group::forward).to_vector<float>()[state.input_slot], 0.0f) << "nothing quantized";
}

// Each prologue folded into the quantization gives the codes, amax and
// sums of the op's own pass followed by the plain quantization.
TEST(Fp8Ops, APrologueIsTheOpThenTheQuantization) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  std::mt19937_64 rng(seed);
  for (Fp8Prologue p : {Fp8Prologue::relu_backward, Fp8Prologue::gelu_erf, Fp8Prologue::gelu_tanh,
                        Fp8Prologue::gelu_erf_backward, Fp8Prologue::gelu_tanh_backward})
    for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
      SCOPED_TRACE(fmt::format("{} {}", fp8_prologue_name(p), dtype_name(dtype)));
      const Tensor in = prim::to(from_vector(spread_values(96 * 40, rng, true), {96, 40}), dtype);
      const Tensor aux = fp8_prologue_has_aux(p)
                             ? prim::to(from_vector(spread_values(96 * 40, rng, false), {96, 40}), dtype)
                             : Tensor();
      const Tensor scale = full({1}, 0.75), amax_fused = zeros({1}), amax_plain = zeros({1});
      const prim::Fp8Quantized fused = prim::quantize_fp8(in, DType::e5m2, scale, amax_fused, true, p, aux, true);
      const prim::Fp8Quantized plain =
          prim::quantize_fp8(prim::fp8_prologue(p, in, aux), DType::e5m2, scale, amax_plain, true, Fp8Prologue::none,
                             Tensor(), true);
      EXPECT_EQ(codes_of(fused.data), codes_of(plain.data));
      EXPECT_EQ(codes_of(fused.data_t), codes_of(plain.data_t));
      EXPECT_EQ(codes_of(amax_fused), codes_of(amax_plain));
      EXPECT_EQ(codes_of(fused.column_sums), codes_of(plain.column_sums));
    }
  // The ReLU's backward selects, as relu_backward does: a non-finite
  // gradient where the output is not positive becomes 0, not NaN.
  const Tensor g = from_vector(std::vector<float>{INFINITY, NAN, 2.0f, -3.0f}, {2, 2});
  const Tensor relu_out = from_vector(std::vector<float>{0.0f, -1.0f, 1.0f, 0.5f}, {2, 2});
  const prim::Fp8Quantized q =
      prim::quantize_fp8(g, DType::e4m3, full({1}, 1.0), Tensor(), false, Fp8Prologue::relu_backward, relu_out);
  EXPECT_EQ(prim::to(q.data, DType::f32).to_vector<float>(), (std::vector<float>{0.0f, 0.0f, 2.0f, -3.0f}));
  // A prologue without its second operand, or one given to none.
  const Tensor one = full({1}, 1.0);
  expect_contains(error_of<ValueError>([&] {
                    prim::quantize_fp8(g, DType::e4m3, one, Tensor(), false, Fp8Prologue::gelu_erf_backward);
                  }),
                  {"quantize_fp8", "gelu_erf_backward", "needs an aux tensor"});
  expect_contains(error_of<ValueError>([&] {
                    prim::quantize_fp8(g, DType::e4m3, one, Tensor(), false, Fp8Prologue::none, g);
                  }),
                  {"quantize_fp8", "none", "takes no aux tensor"});
  expect_contains(error_of<ShapeError>([&] {
                    prim::quantize_fp8(g, DType::e4m3, one, Tensor(), false, Fp8Prologue::relu_backward,
                                       zeros({4, 1}));
                  }),
                  {"quantize_fp8", "aux", "[4, 1]"});
}

// fp8_mlp is fp8_linear, gelu, fp8_linear, bit for bit: over steps of
// delayed scaling (each step's scales from the last one's amaxes) and of
// current scaling, for both GELU forms, and for a shape FP8 products cannot
// take (10 rows: both layers fall back to 16 bits).
TEST(Fp8Linear, MlpIsTheTwoLayersAndGeluBitForBit) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  testing::expect_fp8_mlp_is_the_ops(kCPU, {{64, 32, 128, 48}, {10, 32, 64, 16}}, seed);
}

// GPT's blocks run their MLP as one fp8_mlp unless StepOptions says
// otherwise, and training ends with the same weights and scaling state
// either way.
TEST(Fp8Linear, GptTrainsTheSameWithTheFusedMlpAndWithout) {
  struct Run {
    std::vector<std::vector<uint8_t>> weights, scaling;
  };
  auto train = [](bool fused) {
    Generator gen(5);
    nn::GPT model({.vocab_size = 48, .context = 16, .d_model = 32, .n_layers = 2, .n_heads = 2}, &gen);
    optim::AdamW optimizer(model.parameters(), optim::AdamWOptions{1e-2, 0.9, 0.99, 1e-8, 0.1});
    train::StepOptions options;
    options.precision = train::Precision::fp8;
    options.fp8.history_length = 4;
    options.fp8_fused_mlp = fused;
    train::MixedPrecision precision(options, optimizer, DeviceType::cpu);
    precision.attach_fp8(model, kCPU);
    std::mt19937_64 rng(9);
    for (int step = 0; step < 3; ++step) {
      std::vector<int64_t> tokens(2 * 16), targets(2 * 16);
      for (int64_t& t : tokens) t = static_cast<int64_t>(rng() % 48);
      for (int64_t& t : targets) t = static_cast<int64_t>(rng() % 48);
      const Tensor x = from_vector(tokens, {2, 16}, DType::i64), y = from_vector(targets, {2 * 16}, DType::i64);
      const Tensor loss = precision.forward(
          [&] { return cross_entropy(reshape(to(model.forward(x), DType::f32), {2 * 16, 48}), y); });
      precision.backward(loss);
      precision.step();
      optimizer.zero_grad();
    }
    Run run;
    for (const Tensor& p : model.parameters()) run.weights.push_back(codes_of(p));
    for (const auto& [name, t] : precision.fp8_scaling()->state()) run.scaling.push_back(codes_of(t));
    return run;
  };
  const Run fused = train(true), composed = train(false);
  EXPECT_EQ(fused.weights, composed.weights);
  EXPECT_EQ(fused.scaling, composed.scaling);
}

TEST(Fp8Scaling, StatsCountSaturatedAndFlushedElements) {
  // At scale 2 in e4m3: 300 -> 600 saturates (max 448); 1e-4 -> 2e-4 is
  // below half the smallest subnormal (2^-10) and flushes; 2^-11 -> 2^-10
  // is exactly half and rounds to even, 0: flushed too; 0 and NaN are
  // neither.
  const Tensor x = from_vector(std::vector<float>{300.0f, -1e-4f, std::ldexp(1.0f, -11), 0.0f, NAN, 1.0f, -230.0f, 0.5f},
                               {2, 4});
  const amp::Fp8QuantizationStats s = amp::fp8_quantization_stats(x, full({1}, 2.0), DType::e4m3);
  EXPECT_EQ(s.saturated, 2.0 / 8);  // 300 and -230 (460 > 448)
  EXPECT_EQ(s.flushed, 2.0 / 8);
  EXPECT_EQ(s.scale, 2.0);
  EXPECT_TRUE(std::isnan(s.amax));
  // The fractions are those of the codes the quantization writes.
  const prim::Fp8Quantized q = prim::quantize_fp8(x, DType::e4m3, full({1}, 2.0), Tensor(), false);
  const std::vector<uint8_t> codes = codes_of(q.data);
  EXPECT_EQ(codes[0], 0x7E);  // 448
  EXPECT_EQ(codes[1] & 0x7F, 0x00);
  EXPECT_EQ(codes[2] & 0x7F, 0x00);
  EXPECT_EQ(codes[6], 0xFE);  // -448
}

TEST(Fp8Scaling, DelayedUpdatesFollowTheWrittenRule) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  std::mt19937_64 rng(seed);
  amp::Fp8Recipe recipe;
  recipe.history_length = 3;
  recipe.margin = 1.0f;
  amp::Fp8Scaling scaling(recipe, kCPU);
  ASSERT_EQ(scaling.add_slots(Fp8Group::forward, 2), 0);
  ASSERT_EQ(scaling.add_slots(Fp8Group::backward, 1), 0);
  // The rule replayed on host copies, step by step.
  std::vector<float> history(3 * 3, 0.0f), scale(3, 1.0f);
  std::vector<int64_t> recorded(3, 0);
  const float targets[3] = {amp::fp8_target_max(amp::kE4m3Max, 1), amp::fp8_target_max(amp::kE4m3Max, 1),
                            amp::fp8_target_max(amp::kE5m2Max, 1)};
  for (int step = 0; step < 12; ++step) {
    SCOPED_TRACE(step);
    float amax[3] = {0, 0, 0};
    for (int slot = 0; slot < 3; ++slot) {
      const Fp8Group group = slot < 2 ? Fp8Group::forward : Fp8Group::backward;
      const int64_t index = slot < 2 ? slot : 0;
      std::vector<float> v = spread_values(16, rng, false);
      if (step == 4 && slot == 0) v.assign(16, 0.0f);          // an all-zero tensor
      if (step == 7 && slot == 1) v[3] = NAN;                   // an overflowed one
      if (step == 9 && slot == 2) v[0] = INFINITY;
      const Tensor t = from_vector(v, {4, 4});
      // Used with the slot's current scale.
      const float s = scaling.scale(group).to_vector<float>()[index];
      ASSERT_EQ(s, scale[slot]);
      const prim::Fp8Quantized q = scaling.quantize(group, index, t, false);
      EXPECT_EQ(codes_of(q.data)[5], float_to_fp8_bits(v[5] * s, format_of(amp::fp8_format(group)),
                                                      Fp8Saturation::finite));
      amax[slot] = scalar(prim::slice(scaling.amax(group), 0, index, index + 1));
    }
    scaling.update();
    for (int slot = 0; slot < 3; ++slot)
      amp::update_delayed_scaling({targets[slot], 3, amp::AmaxReduction::max}, amax[slot],
                                  {history.data() + slot * 3, recorded.data() + slot, scale.data() + slot});
    EXPECT_EQ(scaling.amax(Fp8Group::forward).to_vector<float>(), std::vector<float>(2, 0.0f));
  }
  EXPECT_EQ(scaling.history(Fp8Group::forward).to_vector<float>(), std::vector<float>(history.begin(), history.begin() + 6));
  EXPECT_EQ(scaling.history(Fp8Group::backward).to_vector<float>(), std::vector<float>(history.begin() + 6, history.end()));
}

TEST(Fp8Scaling, StateRoundTripsAndAMismatchChangesNothing) {
  amp::Fp8Recipe recipe;
  recipe.history_length = 4;
  amp::Fp8Scaling a(recipe, kCPU);
  a.add_slots(Fp8Group::forward, 2);
  a.add_slots(Fp8Group::backward, 1);
  std::mt19937_64 rng(3);
  for (int step = 0; step < 3; ++step) {
    a.quantize(Fp8Group::forward, 0, from_vector(spread_values(16, rng, false), {4, 4}), false);
    a.quantize(Fp8Group::backward, 0, from_vector(spread_values(16, rng, false), {4, 4}), false);
    a.update();
  }
  amp::Fp8Scaling b(recipe, kCPU);
  b.add_slots(Fp8Group::forward, 2);
  b.add_slots(Fp8Group::backward, 1);
  b.load_state(a.state());
  for (size_t i = 0; i < a.state().size(); ++i)
    EXPECT_EQ(a.state()[i].second.to_vector<double>(), b.state()[i].second.to_vector<double>()) << a.state()[i].first;

  amp::Fp8Recipe longer = recipe;
  longer.history_length = 8;
  amp::Fp8Scaling c(longer, kCPU);
  c.add_slots(Fp8Group::forward, 2);
  c.add_slots(Fp8Group::backward, 1);
  const std::vector<float> before = c.scale(Fp8Group::forward).to_vector<float>();
  expect_contains(error_of<ValueError>([&] { c.load_state(a.state()); }), {"history", "history length"});
  EXPECT_EQ(c.scale(Fp8Group::forward).to_vector<float>(), before);
  expect_contains(error_of<ValueError>([&] { amp::Fp8Scaling(amp::Fp8Recipe{amp::Fp8ScalingMode::delayed, 0}, kCPU); }),
                  {"history length", "at least 1"});
}

}  // namespace
}  // namespace mpt
