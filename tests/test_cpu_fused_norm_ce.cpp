// The CPU's fused layer norm and softmax cross-entropy (tensor/cpu/
// cpu_layer_norm.cpp, cpu_cross_entropy.cpp) against their definitions in
// f64 on fresh random inputs (seed printed on failure): the kernels through
// the prim ops, every dtype they take (f32, bf16, f16, and f32 written in
// 16 bits), ragged rows, with and without parameters; then the autograd
// ops, which now take them on the CPU, against the same ops in f64 (which
// keep the composed path); and their runs, bit for bit.
//
// The references take the inputs as rounded to their dtypes, so what
// remains is the f32 math's error and the one rounding of each result to
// its dtype; the tolerances below are those two.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "autograd/ops.h"
#include "tensor/backend.h"
#include "tensor/backend_settings.h"
#include "tests/layer_norm_narrow_copy.h"
#include "tests/layer_norm_ref.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

using testing::host_f64;
using testing::round_to;
using testing::layer_norm_ref;
using testing::LayerNormRef;
using testing::rel_error;

// The unit roundoff of dt: the most one rounding to nearest moves a value,
// relative to it (2^-p for p significand bits).
double unit_roundoff(DType dt) {
  switch (dt) {
    case DType::bf16: return std::ldexp(1.0, -8);
    case DType::f16: return std::ldexp(1.0, -11);
    case DType::f32: return std::ldexp(1.0, -24);
    default: return 0;
  }
}

// Fails at the first element of `got` outside `exact` +- (what rounding the
// exact value to dt moves it + slack(i)); counts the rest.
template <typename Slack>
void expect_rounded(const std::vector<double>& got, const std::vector<double>& exact, DType dt, Slack&& slack,
                    const std::string& what) {
  ASSERT_EQ(got.size(), exact.size()) << what;
  int64_t wrong = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double allowed = std::fabs(round_to(exact[i], dt) - exact[i]) + slack(i);
    if (std::fabs(got[i] - exact[i]) <= allowed) continue;
    if (wrong++ == 0)
      ADD_FAILURE() << what << ": element " << i << " is " << got[i] << ", exactly " << exact[i] << " (allowed "
                    << allowed << ")";
  }
  EXPECT_EQ(wrong, 0) << what << ": elements out of tolerance";
}

// ---- Layer norm -----------------------------------------------------------

struct NormDtypes {
  DType x, y;
};
const NormDtypes kNormDtypes[] = {{DType::f32, DType::f32},  {DType::bf16, DType::bf16}, {DType::f16, DType::f16},
                                  {DType::f32, DType::bf16}, {DType::f32, DType::f16}};

// The fused forward and backward passes on `rows` rows of d (laid out
// [2, rows / 2, d] where rows is even, to show that only the last dimension
// is normalised), against layer_norm_ref in f64.
void check_layer_norm(Generator& gen, NormDtypes dt, int64_t rows, int64_t d, bool with_w, bool with_b,
                      bool with_more) {
  SCOPED_TRACE(::testing::Message() << dtype_name(dt.x) << " -> " << dtype_name(dt.y) << ", " << rows << " rows of "
                                    << d << (with_w ? ", weight" : "") << (with_b ? ", bias" : "")
                                    << (with_more ? ", grad_x_more" : ""));
  const Shape shape = rows % 2 == 0 ? Shape{2, rows / 2, d} : Shape{rows, d};
  const double eps = 1e-5;
  const Tensor x = prim::to(prim::add_scalar(prim::mul_scalar(randn(shape, DType::f32, kCPU, &gen), 2.0), 0.5), dt.x);
  const Tensor w = with_w ? prim::to(randn({d}, DType::f32, kCPU, &gen), dt.x) : Tensor();
  const Tensor b = with_b ? prim::to(randn({d}, DType::f32, kCPU, &gen), dt.x) : Tensor();
  const Tensor dy = prim::to(randn(shape, DType::f32, kCPU, &gen), dt.y);
  const Tensor more = with_more ? prim::to(randn(shape, DType::f32, kCPU, &gen), dt.x) : Tensor();
  ASSERT_TRUE(prim::fused_layer_norm_available(x, w, b, dt.y));

  const std::vector<Tensor> fwd = prim::layer_norm_forward(x, w, b, eps, dt.y);
  const std::vector<Tensor> bwd = prim::layer_norm_backward(dy, x, w, fwd[1], fwd[2], with_w, with_b, more);
  ASSERT_EQ(fwd[0].dtype(), dt.y);
  ASSERT_EQ(bwd[0].dtype(), dt.x);

  const std::vector<double> wv = with_w ? host_f64(w) : std::vector<double>{};
  const std::vector<double> bv = with_b ? host_f64(b) : std::vector<double>{};
  const std::vector<double> xv = host_f64(x);
  const LayerNormRef ref = layer_norm_ref(xv, wv, bv, d, eps, host_f64(dy));

  // y: the exact norm rounded once to y's dtype, give or take the f32
  // math's error (a few units of f32 rounding in xhat, relative to
  // |w| (1 + |xhat|), and in the bias's add).
  const auto at = [d](const std::vector<double>& p, size_t i, double absent) {
    return p.empty() ? absent : p[i % static_cast<size_t>(d)];
  };
  expect_rounded(host_f64(fwd[0]), ref.y, dt.y,
                 [&](size_t i) {
                   return 1e-5 * std::fabs(at(wv, i, 1.0)) * (1 + std::fabs(ref.xhat[i])) +
                          1e-6 * std::fabs(at(bv, i, 0.0));
                 },
                 "forward");

  // The saved statistics: each row's mean and 1 / sqrt(var + eps). An f32
  // sum of d terms in eight lanes rounds each term at most d / 8 + 3 times,
  // so it is within (d / 8 + 3) units of f32 rounding of the sum of the
  // terms' magnitudes; the divisions, the square root and the mean's error
  // inside the variance add a few more.
  const double u = unit_roundoff(DType::f32), roundings = static_cast<double>(d) / 8 + 8;
  const std::vector<double> got_mean = host_f64(fwd[1]), got_rstd = host_f64(fwd[2]);
  // Each row's mean |x| and rstd, for the parameter gradients' bounds below.
  std::vector<double> row_magnitude(static_cast<size_t>(rows)), row_rstd(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    double m = 0, magnitude = 0, v = 0;
    for (int64_t j = 0; j < d; ++j) {
      m += xv[r * d + j];
      magnitude += std::fabs(xv[r * d + j]);
    }
    m /= static_cast<double>(d);
    for (int64_t j = 0; j < d; ++j) v += (xv[r * d + j] - m) * (xv[r * d + j] - m);
    const double rs = 1 / std::sqrt(v / static_cast<double>(d) + eps);
    row_magnitude[r] = magnitude / static_cast<double>(d);
    row_rstd[r] = rs;
    EXPECT_NEAR(got_mean[r], m, roundings * u * magnitude / static_cast<double>(d)) << "mean of row " << r;
    EXPECT_NEAR(got_rstd[r], rs, roundings * u * rs) << "rstd of row " << r;
  }

  // dx (plus the other path's gradient) rounded once to x's dtype: within
  // a rounding of it, element by element, in the norm; the f32 math's
  // error (sums over the row, cancelling in g - mean(g) - xhat mean(g xhat))
  // stays far below 1e-5 of the norm.
  std::vector<double> gx = ref.gx;
  if (with_more) {
    const std::vector<double> mv = host_f64(more);
    for (size_t i = 0; i < gx.size(); ++i) gx[i] += mv[i];
  }
  EXPECT_LE(rel_error(host_f64(bwd[0]), gx), unit_roundoff(dt.x) + 1e-5) << "gradient of x";
  // The parameters' gradients, f32 sums over the rows of dy * xhat and of
  // dy: column by column (a column's sum may cancel to near 0), within
  // rows + 2 units of f32 rounding of the terms' magnitudes (any order of
  // adding them gives that), plus, for the weight's, dy times xhat's error
  // (the statistics' error, as bounded above).
  ASSERT_EQ(bwd[1].defined(), with_w);
  ASSERT_EQ(bwd[2].defined(), with_b);
  const std::vector<double> dyv = host_f64(dy);
  std::vector<double> w_slack(static_cast<size_t>(d)), b_slack(static_cast<size_t>(d));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < d; ++j) {
      const size_t i = static_cast<size_t>(r * d + j);
      const double xhat_error = roundings * u * (std::fabs(ref.xhat[i]) + row_rstd[r] * row_magnitude[r]);
      w_slack[j] += static_cast<double>(rows + 2) * u * std::fabs(dyv[i] * ref.xhat[i]) + std::fabs(dyv[i]) * xhat_error;
      b_slack[j] += static_cast<double>(rows + 2) * u * std::fabs(dyv[i]);
    }
  if (with_w) {
    ASSERT_EQ(bwd[1].dtype(), DType::f32);
    expect_rounded(host_f64(bwd[1]), ref.gw, DType::f64, [&](size_t j) { return w_slack[j]; },
                   "gradient of the weight");
  }
  if (with_b) {
    ASSERT_EQ(bwd[2].dtype(), DType::f32);
    expect_rounded(host_f64(bwd[2]), ref.gb, DType::f64, [&](size_t j) { return b_slack[j]; },
                   "gradient of the bias");
  }
}

// Rows of 1 (a norm of nothing but the bias), 7 (shorter than a vector),
// 384 (gpt_mini's) and 1000 (a ragged tail); one row, and 200 (several
// blocks of the parameter sums, split over threads where there are two).
TEST(CpuFusedLayerNorm, MatchesItsDefinitionInF64) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  for (const NormDtypes dt : kNormDtypes)
    for (int64_t d : {1, 7, 384, 1000})
      for (int64_t rows : {1, 200})
        for (int params = 0; params < 4; ++params) {
          check_layer_norm(gen, dt, rows, d, params & 1, params & 2, params == 3);
          if (::testing::Test::HasFatalFailure()) return;
        }
}

// An f32 x normalised into 16 bits (a residual stream under autocast): the
// backward leaves the gradient's 16-bit copy for the cast to take.
TEST(CpuFusedLayerNorm, BackwardLeavesTheSixteenBitCopyTheCastMakes) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  for (DType out : {DType::f16, DType::bf16})
    for (int64_t d : {7, 384})
      for (bool with_more : {false, true}) {
        testing::check_layer_norm_narrow_copy(kCPU, gen, 9, d, out, with_more);
        if (::testing::Test::HasFatalFailure()) return;
      }
  // In f32 throughout there is nothing narrower to leave.
  const Tensor x = randn({3, 8}, DType::f32, kCPU, &gen), dy = randn({3, 8}, DType::f32, kCPU, &gen);
  const std::vector<Tensor> fwd = prim::layer_norm_forward(x, Tensor(), Tensor(), 1e-5, DType::f32);
  const Tensor gx = prim::layer_norm_backward(dy, x, Tensor(), fwd[1], fwd[2], false, false, Tensor())[0];
  for (DType dt : {DType::f16, DType::bf16}) EXPECT_EQ(gx.storage()->take_narrow_copy(dt, 0, gx.numel()), nullptr);
}

// A copy written since it was left is not handed out: the cast reads the
// values again.
TEST(CpuFusedLayerNorm, ANarrowCopyWrittenSinceIsNotTaken) {
  const Tensor wide = full({4}, 1.0), narrow = prim::to(full({4}, 1.0), DType::f16);
  wide.storage()->set_narrow_copy({narrow.storage(), DType::f16, 0, 4, wide.version(), narrow.version()});
  prim::fill_(narrow, 2.0);
  EXPECT_EQ(wide.storage()->take_narrow_copy(DType::f16, 0, 4), nullptr);
  EXPECT_EQ(host_f64(prim::to(wide, DType::f16)), std::vector<double>(4, 1.0));
}

// No rows: nothing to write but parameter gradients, which are sums over
// nothing (the kernel's own answer, not just the op's shortcut).
TEST(CpuFusedLayerNorm, NoRows) {
  const Tensor x = zeros({0, 7}), w = full({7}, 2.0);
  ASSERT_TRUE(prim::fused_layer_norm_available(x, w, Tensor(), DType::f32));
  const std::vector<Tensor> fwd = prim::layer_norm_forward(x, w, Tensor(), 1e-5, DType::f32);
  EXPECT_EQ(fwd[0].shape(), (Shape{0, 7}));
  const std::vector<Tensor> bwd = prim::layer_norm_backward(zeros({0, 7}), x, w, fwd[1], fwd[2], true, true, Tensor());
  EXPECT_EQ(bwd[0].shape(), (Shape{0, 7}));
  EXPECT_EQ(host_f64(bwd[1]), std::vector<double>(7, 0.0));
  EXPECT_EQ(host_f64(bwd[2]), std::vector<double>(7, 0.0));

  Tensor gw = full({7}, NAN), gb = full({7}, NAN);
  const Tensor gx = zeros({0, 7});
  backend_for(kCPU).layer_norm_backward(gx.view(), TensorView{}, gw.view(), gb.view(), zeros({0, 7}).view(),
                                        TensorView{}, x.view(), w.view(), zeros({0, 1}).view(), zeros({0, 1}).view());
  EXPECT_EQ(host_f64(gw), std::vector<double>(7, 0.0));
  EXPECT_EQ(host_f64(gb), std::vector<double>(7, 0.0));
}

// The kernel refuses what it does not take, naming itself and the operands.
TEST(CpuFusedLayerNorm, RefusesWhatItDoesNotTake) {
  Backend& cpu = backend_for(kCPU);
  EXPECT_FALSE(cpu.fused_layer_norm_supported(DType::f64, DType::f64, 8));
  EXPECT_FALSE(cpu.fused_layer_norm_supported(DType::bf16, DType::f32, 8));
  EXPECT_FALSE(cpu.fused_layer_norm_supported(DType::f16, DType::bf16, 8));
  EXPECT_FALSE(cpu.fused_layer_norm_supported(DType::f32, DType::f32, 0));
  const Tensor x64 = zeros({3, 8}, DType::f64), y64 = zeros({3, 8}, DType::f64), s = zeros({3, 1});
  testing::expect_contains(testing::error_of<DTypeError>([&] {
                             cpu.layer_norm_forward(y64.view(), s.view(), s.view(), x64.view(), TensorView{},
                                                    TensorView{}, 1e-5);
                           }),
                           {"CPU layer_norm", "f64", "[3, 8]"});
  const Tensor x = zeros({3, 8}), y = zeros({3, 8}), short_stats = zeros({2});
  testing::expect_contains(testing::error_of<ShapeError>([&] {
                             cpu.layer_norm_forward(y.view(), short_stats.view(), s.view(), x.view(), TensorView{},
                                                    TensorView{}, 1e-5);
                           }),
                           {"CPU layer_norm", "mean and rstd", "[2]"});
}

// ---- Cross-entropy ----------------------------------------------------------

// loss, lse and the gradient (softmax - onehot) * row_scale by their
// definitions in f64.
struct CrossEntropyRef {
  std::vector<double> loss, lse, valid, grad;
};
CrossEntropyRef cross_entropy_ref(const std::vector<double>& x, const std::vector<int64_t>& target,
                                  const std::vector<double>& row_scale, int64_t classes, int64_t ignore_index) {
  const size_t rows = target.size();
  CrossEntropyRef r;
  r.loss.resize(rows);
  r.lse.resize(rows);
  r.valid.resize(rows);
  r.grad.resize(x.size());
  for (size_t i = 0; i < rows; ++i) {
    const double* row = x.data() + i * classes;
    const double m = *std::max_element(row, row + classes);
    double s = 0;
    for (int64_t c = 0; c < classes; ++c) s += std::exp(row[c] - m);
    r.lse[i] = m + std::log(s);
    const bool counts = target[i] != ignore_index;
    r.valid[i] = counts ? 1 : 0;
    r.loss[i] = counts ? r.lse[i] - row[target[i]] : 0;
    for (int64_t c = 0; c < classes; ++c)
      r.grad[i * classes + c] = (std::exp(row[c] - r.lse[i]) - (c == target[i] ? 1 : 0)) * row_scale[i];
  }
  return r;
}

// Targets in [0, classes), every fifth one ignore_index.
std::vector<int64_t> draw_targets(std::mt19937_64& rng, int64_t rows, int64_t classes, int64_t ignore_index) {
  std::vector<int64_t> t(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i)
    t[i] = i % 5 == 3 ? ignore_index : static_cast<int64_t>(rng() % static_cast<uint64_t>(classes));
  return t;
}

// The fused forward and backward passes on logits spread over +-spread
// (1e4: exp overflows without the maximum subtracted), against
// cross_entropy_ref.
void check_cross_entropy(Generator& gen, std::mt19937_64& rng, DType dt, int64_t rows, int64_t classes, double spread,
                         int64_t ignore_index) {
  SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " [" << rows << ", " << classes << "] logits within +-"
                                    << spread << ", ignore_index " << ignore_index);
  const Tensor logits = prim::to(rand({rows, classes}, DType::f32, kCPU, &gen, -spread, spread), dt);
  const std::vector<int64_t> tv = draw_targets(rng, rows, classes, ignore_index);
  const Tensor target = from_vector(tv, {rows}, DType::i64);
  const Tensor row_scale = randn({rows}, DType::f32, kCPU, &gen);
  ASSERT_TRUE(prim::fused_cross_entropy_available(logits));
  const std::vector<Tensor> fwd = prim::cross_entropy_forward(logits, target, ignore_index);
  const Tensor grad = prim::cross_entropy_backward(logits, target, fwd[1], row_scale);
  ASSERT_EQ(grad.dtype(), dt);

  const std::vector<double> xv = host_f64(logits), sv = host_f64(row_scale);
  const CrossEntropyRef ref = cross_entropy_ref(xv, tv, sv, classes, ignore_index);
  EXPECT_EQ(host_f64(fwd[2]), ref.valid) << "valid";
  // lse = max + log(sum): rounded to f32 at its magnitude (what a logit of
  // 1e4 leaves: units of 1e-3), plus the sum's f32 error (a few units of
  // f32 rounding in each of up to 256 terms a lane) through the log.
  const double u = unit_roundoff(DType::f32);
  auto lse_slack = [&](size_t row) { return 4 * u * std::fabs(ref.lse[row]) + 2e-5; };
  expect_rounded(host_f64(fwd[1]), ref.lse, DType::f64, lse_slack, "lse");
  expect_rounded(host_f64(fwd[0]), ref.loss, DType::f64,
                 [&](size_t row) { return ref.valid[row] * (lse_slack(row) + 2 * u * std::fabs(ref.loss[row])); },
                 "loss");
  // The gradient, rounded once to dt: softmax = exp(logit - lse) carries
  // lse's error and that of the difference's rounding, relative; the
  // scale's product and the subtracted 1 add a few units of f32 rounding.
  expect_rounded(host_f64(grad), ref.grad, dt,
                 [&](size_t i) {
                   const size_t row = i / static_cast<size_t>(classes);
                   const double p = std::exp(xv[i] - ref.lse[row]);
                   const double scale = std::fabs(sv[row]);
                   return scale * (p * (lse_slack(row) + 2 * u * std::fabs(xv[i] - ref.lse[row]) + 4 * u) + 4 * u);
                 },
                 "gradient");
}

// One class (the loss is 0 and the gradient 0), gpt_mini's character
// vocabulary (65), a ragged 1000, and GPT-2's 50304 (longer than one block
// of the sum); 1024 rows split over threads. Ignored rows marked -100, or
// a class id (2), which a row may also draw as its target.
TEST(CpuFusedCrossEntropy, MatchesItsDefinitionInF64) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  std::mt19937_64 rng(seed);
  const std::pair<int64_t, int64_t> shapes[] = {{37, 1}, {37, 65}, {1024, 65}, {9, 1000}, {3, 50304}};
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (const auto& [rows, classes] : shapes)
      for (double spread : {3.0, 1e4})
        for (int64_t ignore_index : {int64_t{-100}, int64_t{2}}) {
          check_cross_entropy(gen, rng, dt, rows, classes, spread, ignore_index);
          if (::testing::Test::HasFatalFailure()) return;
        }
}

// A NaN logit makes its row's loss NaN (what a loss scaler looks for), and
// -inf logits (masked classes) add nothing to the softmax and get no
// gradient.
TEST(CpuFusedCrossEntropy, NanAndMaskedLogits) {
  const float inf = std::numeric_limits<float>::infinity();
  const Tensor logits = from_vector(std::vector<float>{1, NAN, 0, -inf, 2, -inf, -inf, 0.5f}, {2, 4});
  const Tensor target = from_vector(std::vector<int64_t>{0, 3}, {2}, DType::i64);
  const std::vector<Tensor> fwd = prim::cross_entropy_forward(logits, target, -100);
  const std::vector<double> loss = host_f64(fwd[0]);
  EXPECT_TRUE(std::isnan(loss[0]));
  const double lse = 2 + std::log(1 + std::exp(0.5 - 2));
  EXPECT_NEAR(loss[1], lse - 0.5, 1e-6);
  const std::vector<double> grad =
      host_f64(prim::cross_entropy_backward(logits, target, fwd[1], full({2}, 1.0)));
  EXPECT_EQ(grad[5], 0.0);
  EXPECT_EQ(grad[6], 0.0);
  EXPECT_NEAR(grad[4], std::exp(2 - lse), 1e-6);
  EXPECT_NEAR(grad[7], std::exp(0.5 - lse) - 1, 1e-6);
}

// No rows: the autograd op sums nothing (reduction sum: 0, and an empty
// gradient), and the kernels write nothing.
TEST(CpuFusedCrossEntropy, NoRows) {
  Tensor logits = zeros({0, 5});
  logits.set_requires_grad(true);
  const Tensor target = zeros({0}, DType::i64);
  const Tensor loss = cross_entropy(logits, target, -100, Reduction::sum);
  EXPECT_EQ(host_f64(loss), std::vector<double>{0.0});
  backward(loss);
  ASSERT_TRUE(logits.grad().defined());
  EXPECT_EQ(logits.grad().shape(), (Shape{0, 5}));
  EXPECT_EQ(cross_entropy(logits, target, -100, Reduction::none).shape(), (Shape{0}));

  Backend& cpu = backend_for(kCPU);
  const Tensor per_row = zeros({0}), g = zeros({0, 5});
  cpu.cross_entropy_forward(per_row.view(), per_row.view(), per_row.view(), logits.view(), target.view(), -100);
  cpu.cross_entropy_backward(g.view(), logits.view(), target.view(), per_row.view(), per_row.view());
}

TEST(CpuFusedCrossEntropy, RefusesWhatItDoesNotTake) {
  Backend& cpu = backend_for(kCPU);
  EXPECT_FALSE(cpu.fused_cross_entropy_supported(DType::f64));
  const Tensor logits = zeros({4, 3}), per_row = zeros({4}), wrong_rows = zeros({3});
  const Tensor target32 = zeros({4}, DType::i32), target = zeros({4}, DType::i64);
  testing::expect_contains(testing::error_of<DTypeError>([&] {
                             cpu.cross_entropy_forward(per_row.view(), per_row.view(), per_row.view(), logits.view(),
                                                       target32.view(), -100);
                           }),
                           {"CPU cross_entropy", "i64", "i32"});
  testing::expect_contains(testing::error_of<ShapeError>([&] {
                             cpu.cross_entropy_backward(logits.view(), logits.view(), target.view(), per_row.view(),
                                                        wrong_rows.view());
                           }),
                           {"CPU cross_entropy backward", "row scale", "[4]", "[3]"});
}

// ---- Through autograd -------------------------------------------------------

// The autograd ops on the CPU: the fused path for f32, f16 and bf16 (and
// f32 written in 16 bits), the composed one for f64 and while the fused
// kernels are switched off.
TEST(CpuFusedNormCe, AutogradTakesTheFusedPathForTheKernelsDtypes) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  const Tensor x = randn({6, 32}, DType::f32, kCPU, &gen), w = randn({32}, DType::f32, kCPU, &gen);
  for (const NormDtypes dt : kNormDtypes) {
    const Tensor xd = prim::to(x, dt.x), wd = prim::to(w, dt.x);
    EXPECT_TRUE(prim::fused_layer_norm_available(xd, wd, wd, dt.y)) << dtype_name(dt.x) << " -> " << dtype_name(dt.y);
  }
  const Tensor x64 = prim::to(x, DType::f64);
  EXPECT_FALSE(prim::fused_layer_norm_available(x64, Tensor(), Tensor(), DType::f64));
  EXPECT_FALSE(prim::fused_layer_norm_available(prim::to(x, DType::bf16), Tensor(), Tensor(), DType::f32));
  EXPECT_TRUE(prim::fused_cross_entropy_available(x));
  EXPECT_FALSE(prim::fused_cross_entropy_available(x64));
  set_cpu_fused_kernels(false);
  EXPECT_FALSE(cpu_fused_kernels());
  EXPECT_FALSE(prim::fused_layer_norm_available(x, w, w, DType::f32));
  EXPECT_FALSE(prim::fused_cross_entropy_available(x));
  set_cpu_fused_kernels(true);
  EXPECT_TRUE(prim::fused_layer_norm_available(x, w, w, DType::f32));

  // The autograd ops' results are the kernels' (bit for bit).
  EXPECT_EQ(layer_norm(x, w, w).to_vector<float>(),
            prim::layer_norm_forward(x, w, w, 1e-5, DType::f32)[0].to_vector<float>());
  const Tensor target = from_vector(std::vector<int64_t>{0, 31, 7, 7, 1, 2}, {6}, DType::i64);
  EXPECT_EQ(cross_entropy(x, target, -100, Reduction::none).to_vector<float>(),
            prim::cross_entropy_forward(x, target, -100)[0].to_vector<float>());
}

// A leaf copy of t in dtype dt that takes gradients.
Tensor leaf_as(const Tensor& t, DType dt) {
  Tensor out = prim::clone(prim::to(t, dt));
  out.set_requires_grad(true);
  return out;
}

// The autograd layer norm (and the norm with its input passed on beside
// it, whose backward adds the skip path's gradient in the kernel) in each
// of the kernels' dtypes against the same op in f64, which composes it:
// output, and the gradients of x, weight and bias.
TEST(CpuFusedNormCe, AutogradLayerNormMatchesTheComposedF64) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  const int64_t d = 96;
  const Shape shape{4, 7, d};
  for (const NormDtypes dt : kNormDtypes)
    for (bool skip : {false, true}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dt.x) << " -> " << dtype_name(dt.y)
                                        << (skip ? ", with skip" : ""));
      // Inputs rounded to dt.x, so that the f64 run sees the same values.
      const Tensor x0 = prim::to(randn(shape, DType::f32, kCPU, &gen), dt.x);
      const Tensor w0 = prim::to(randn({d}, DType::f32, kCPU, &gen), dt.x);
      const Tensor b0 = prim::to(randn({d}, DType::f32, kCPU, &gen), dt.x);
      // The norm's output gradient as its dtype carries it, in both runs.
      const Tensor dnorm = prim::to(prim::to(randn(shape, DType::f64, kCPU, &gen), dt.y), DType::f64);
      const Tensor dskip = randn(shape, DType::f64, kCPU, &gen);
      // {norm, dx, dw, db} of the run in dtype `x_dtype`, writing `y_dtype`.
      auto run = [&](DType x_dtype, DType y_dtype) {
        Tensor x = leaf_as(x0, x_dtype), w = leaf_as(w0, x_dtype), b = leaf_as(b0, x_dtype);
        Tensor normed, passed;
        if (skip) std::tie(passed, normed) = layer_norm_with_skip(x, w, b, 1e-5, y_dtype);
        else normed = layer_norm(x, w, b, 1e-5, y_dtype);
        EXPECT_EQ(normed.dtype(), y_dtype);
        Tensor loss = sum(mul(to(normed, DType::f64), dnorm));
        if (skip) loss = add(loss, sum(mul(to(passed, DType::f64), dskip)));
        backward(loss);
        return std::vector<std::vector<double>>{host_f64(normed), host_f64(x.grad()), host_f64(w.grad()),
                                                host_f64(b.grad())};
      };
      const auto fused = run(dt.x, dt.y), exact = run(DType::f64, DType::f64);
      EXPECT_LE(rel_error(fused[0], exact[0]), unit_roundoff(dt.y) + 1e-5) << "norm";
      // The skip path's gradient reaches x in x's dtype first.
      EXPECT_LE(rel_error(fused[1], exact[1]), 2 * unit_roundoff(dt.x) + 1e-5) << "gradient of x";
      // The parameters' gradients are summed in f32 and rounded to their
      // dtype once.
      EXPECT_LE(rel_error(fused[2], exact[2]), unit_roundoff(dt.x) + 1e-5) << "gradient of the weight";
      EXPECT_LE(rel_error(fused[3], exact[3]), unit_roundoff(dt.x) + 1e-5) << "gradient of the bias";
    }
}

// The autograd cross-entropy in each of the kernels' dtypes against the
// same op in f64, which composes it, for each reduction (ignored rows count
// neither in the sum nor in the mean's count).
TEST(CpuFusedNormCe, AutogradCrossEntropyMatchesTheComposedF64) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  std::mt19937_64 rng(seed);
  const int64_t rows = 50, classes = 65;
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (Reduction reduction : {Reduction::none, Reduction::sum, Reduction::mean}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " reduction " << static_cast<int>(reduction));
      const Tensor logits0 = prim::to(mul(randn({rows, classes}, DType::f32, kCPU, &gen), 3.0), dt);
      const Tensor target = from_vector(draw_targets(rng, rows, classes, -100), {rows}, DType::i64);
      const Tensor upstream = reduction == Reduction::none ? randn({rows}, DType::f64, kCPU, &gen) : full({}, 0.7,
                                                                                                           DType::f64);
      auto run = [&](DType as) {
        Tensor logits = leaf_as(logits0, as);
        const Tensor loss = cross_entropy(logits, target, -100, reduction);
        backward(sum(mul(to(loss, DType::f64), upstream)));
        return std::pair{host_f64(loss), host_f64(logits.grad())};
      };
      const auto [loss, grad] = run(dt);
      const auto [exact_loss, exact_grad] = run(DType::f64);
      EXPECT_LE(rel_error(loss, exact_loss), 1e-5) << "loss";
      EXPECT_LE(rel_error(grad, exact_grad), unit_roundoff(dt) + 1e-5) << "gradient";
    }
}

// Two runs of the fused passes on inputs large enough to be split over the
// threads give the same bits: each row's results are its own, and the
// parameter sums are added in an order fixed by the row count.
TEST(CpuFusedNormCe, RunsAreBitIdentical) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  std::mt19937_64 rng(seed);
  const Tensor x0 = randn({4096, 384}, DType::f32, kCPU, &gen), w0 = randn({384}, DType::f32, kCPU, &gen),
               b0 = randn({384}, DType::f32, kCPU, &gen), dy = randn({4096, 384}, DType::f32, kCPU, &gen);
  const Tensor logits0 = randn({4096, 65}, DType::f32, kCPU, &gen);
  const Tensor target = from_vector(draw_targets(rng, 4096, 65, -100), {4096}, DType::i64);
  auto run = [&] {
    Tensor x = leaf_as(x0, DType::f32), w = leaf_as(w0, DType::f32), b = leaf_as(b0, DType::f32);
    Tensor logits = leaf_as(logits0, DType::f32);
    const Tensor y = layer_norm(x, w, b);
    const Tensor loss = cross_entropy(logits, target);
    backward({y, loss}, {dy, Tensor()});
    std::vector<std::vector<float>> out;
    for (const Tensor& t : {y, loss, x.grad(), w.grad(), b.grad(), logits.grad()}) out.push_back(t.to_vector<float>());
    return out;
  };
  const auto first = run(), second = run();
  for (size_t i = 0; i < first.size(); ++i) {
    ASSERT_EQ(first[i].size(), second[i].size());
    EXPECT_EQ(std::memcmp(first[i].data(), second[i].data(), first[i].size() * sizeof(float)), 0) << "result " << i;
  }
}

}  // namespace
}  // namespace mpt
