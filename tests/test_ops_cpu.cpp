// Every CPU kernel against a straightforward f64 reference, on fresh random
// inputs (seed printed on failure), for each floating dtype; and the split
// of large work over the CPU's threads.
#include <gtest/gtest.h>

#include <fmt/ranges.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <tuple>

#include "tensor/cpu/cpu_threads.h"
#include "tensor/ops.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

using testing::host_f64;
using testing::rel_error;
using testing::tolerance;

const DType kFloatTypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16};

// Values of `values` (contiguous, shape `from`) read at each index of `to`.
std::vector<double> broadcast_values(const std::vector<double>& values, const Shape& from, const Shape& to) {
  const Shape st = broadcast_strides(from, contiguous_strides(from), to);
  std::vector<double> out(static_cast<size_t>(numel(to)));
  std::vector<int64_t> idx(to.size(), 0);
  for (size_t i = 0; i < out.size(); ++i) {
    int64_t off = 0;
    for (size_t d = 0; d < to.size(); ++d) off += idx[d] * st[d];
    out[i] = values[off];
    for (size_t d = to.size(); d-- > 0;) {
      if (++idx[d] < to[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

class OpsCpu : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = testing::fresh_seed();
    gen_.manual_seed(seed_);
  }
  Tensor randn(const Shape& s, DType dt) { return mpt::randn(s, dt, kCPU, &gen_); }
  Tensor rand(const Shape& s, DType dt, double lo, double hi) { return mpt::rand(s, dt, kCPU, &gen_, lo, hi); }
  // Whole numbers from about -12 to 12: exact in every float type, and
  // with many ties.
  std::vector<double> small_integers(const Shape& s) {
    std::vector<double> v = host_f64(randn(s, DType::f64));
    for (double& e : v) e = std::round(4 * e);
    return v;
  }
  std::string trace() const { return fmt::format("seed {}", seed_); }
  uint64_t seed_ = 0;
  Generator gen_;
};

double gelu_tanh_ref(double x) { return 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }
double gelu_erf_ref(double x) { return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0))); }
double numeric_derivative(const std::function<double(double)>& f, double x) {
  const double h = 1e-6;
  return (f(x + h) - f(x - h)) / (2 * h);
}

TEST_F(OpsCpu, UnaryMatchesReference) {
  SCOPED_TRACE(trace());
  struct Case {
    UnaryOp op;
    std::function<double(double)> ref;
    double lo, hi;  // input range
    double alpha = 0, beta = 0;
  };
  const std::vector<Case> cases = {
      {UnaryOp::neg, [](double x) { return -x; }, -3, 3},
      {UnaryOp::exp, [](double x) { return std::exp(x); }, -3, 3},
      {UnaryOp::log, [](double x) { return std::log(x); }, 0.1, 5},
      {UnaryOp::sqrt, [](double x) { return std::sqrt(x); }, 0.1, 5},
      {UnaryOp::rsqrt, [](double x) { return 1 / std::sqrt(x); }, 0.1, 5},
      {UnaryOp::tanh, [](double x) { return std::tanh(x); }, -3, 3},
      {UnaryOp::sigmoid, [](double x) { return 1 / (1 + std::exp(-x)); }, -5, 5},
      {UnaryOp::relu, [](double x) { return x > 0 ? x : 0; }, -3, 3},
      {UnaryOp::gelu_tanh, gelu_tanh_ref, -4, 4},
      {UnaryOp::gelu_erf, gelu_erf_ref, -4, 4},
      {UnaryOp::abs, [](double x) { return std::fabs(x); }, -3, 3},
      {UnaryOp::sin, [](double x) { return std::sin(x); }, -3, 3},
      {UnaryOp::cos, [](double x) { return std::cos(x); }, -3, 3},
      {UnaryOp::square, [](double x) { return x * x; }, -3, 3},
      {UnaryOp::reciprocal, [](double x) { return 1 / x; }, 0.2, 4},
      {UnaryOp::affine, [](double x) { return x * 2.5 - 0.75; }, -3, 3, 2.5, -0.75},
      {UnaryOp::pow_scalar, [](double x) { return std::pow(x, 1.7); }, 0.1, 3, 1.7},
      {UnaryOp::step, [](double x) { return x > 0 ? 1 : 0; }, -3, 3},
  };
  for (DType dt : kFloatTypes) {
    for (const Case& c : cases) {
      SCOPED_TRACE(fmt::format("{} {}", unary_op_name(c.op), dtype_name(dt)));
      // A non-contiguous input: the transpose of a random matrix.
      Tensor x = prim::transpose(rand({7, 13}, dt, c.lo, c.hi), 0, 1);
      Tensor y = prim::unary(c.op, x, c.alpha, c.beta);
      EXPECT_EQ(y.shape(), (Shape{13, 7}));
      std::vector<double> ref = host_f64(x);
      for (double& v : ref) v = c.ref(v);
      EXPECT_LE(rel_error(host_f64(y), ref), tolerance(dt));
    }
  }
}

TEST_F(OpsCpu, BinaryBroadcastsAndMatchesReference) {
  SCOPED_TRACE(trace());
  struct Case {
    BinaryOp op;
    std::function<double(double, double)> ref;
    bool positive = false;
  };
  auto gelu_tanh_grad = [](double x) { return numeric_derivative(gelu_tanh_ref, x); };
  auto gelu_erf_grad = [](double x) { return numeric_derivative(gelu_erf_ref, x); };
  const std::vector<Case> cases = {
      {BinaryOp::add, [](double a, double b) { return a + b; }},
      {BinaryOp::sub, [](double a, double b) { return a - b; }},
      {BinaryOp::mul, [](double a, double b) { return a * b; }},
      {BinaryOp::div, [](double a, double b) { return a / b; }, true},
      {BinaryOp::pow, [](double a, double b) { return std::pow(a, b); }, true},
      // NaN in either operand gives NaN, as torch.maximum / torch.minimum do
      // (std::max and std::min would return the first operand).
      {BinaryOp::maximum, [](double a, double b) { return std::isnan(a) || std::isnan(b) ? NAN : std::max(a, b); }},
      {BinaryOp::minimum, [](double a, double b) { return std::isnan(a) || std::isnan(b) ? NAN : std::min(a, b); }},
      {BinaryOp::eq, [](double a, double b) { return a == b ? 1.0 : 0.0; }},
      {BinaryOp::ne, [](double a, double b) { return a != b ? 1.0 : 0.0; }},
      {BinaryOp::lt, [](double a, double b) { return a < b ? 1.0 : 0.0; }},
      {BinaryOp::le, [](double a, double b) { return a <= b ? 1.0 : 0.0; }},
      {BinaryOp::gt, [](double a, double b) { return a > b ? 1.0 : 0.0; }},
      {BinaryOp::ge, [](double a, double b) { return a >= b ? 1.0 : 0.0; }},
      {BinaryOp::relu_backward, [](double g, double x) { return x > 0 ? g : 0; }},
      {BinaryOp::gelu_tanh_backward, [=](double g, double x) { return g * gelu_tanh_grad(x); }},
      {BinaryOp::gelu_erf_backward, [=](double g, double x) { return g * gelu_erf_grad(x); }},
      {BinaryOp::tanh_backward, [](double g, double y) { return g * (1 - y * y); }},
      {BinaryOp::sigmoid_backward, [](double g, double y) { return g * y * (1 - y); }},
  };
  for (DType dt : kFloatTypes) {
    for (const Case& c : cases) {
      SCOPED_TRACE(fmt::format("{} {}", binary_op_name(c.op), dtype_name(dt)));
      const double lo = c.positive ? 0.2 : -2, hi = 2;
      // a is [1, 3, 5] (a strided permute of [5, 1, 3]), b is [4, 1, 5]; out
      // [i, j, k] = op(a[0, j, k], b[i, 0, k]). Rows 0 and 1 of b are copies
      // of rows 0 and 1 of a, so the comparisons see ties at [0, 0, k] and
      // [1, 1, k]; a NaN in a (at [0, 1, 1], copied into b's row 1) and
      // another in b (at [2, 0, 3]) meet numbers and each other.
      std::vector<double> a_values = host_f64(rand({5, 1, 3}, dt, lo, hi));
      a_values[1 * 3 + 1] = NAN;  // [1, 0, 1] of [5, 1, 3]: a[0, 1, 1]
      const Tensor a = prim::permute(from_vector(a_values, {5, 1, 3}, dt), {1, 2, 0});
      const std::vector<double> a_rows = host_f64(a);  // [1, 3, 5], logical order
      std::vector<double> b_values = host_f64(rand({4, 1, 5}, dt, lo, hi));
      for (int64_t k = 0; k < 10; ++k) b_values[k] = a_rows[k];  // b[0..1, 0, :] = a[0, 0..1, :]
      b_values[2 * 5 + 3] = NAN;
      const Tensor b = from_vector(b_values, {4, 1, 5}, dt);
      Tensor out = prim::binary(c.op, a, b);
      const Shape shape{4, 3, 5};
      ASSERT_EQ(out.shape(), shape);
      const auto av = broadcast_values(host_f64(a), a.shape(), shape);
      const auto bv = broadcast_values(host_f64(b), b.shape(), shape);
      std::vector<double> ref(av.size());
      for (size_t i = 0; i < ref.size(); ++i) ref[i] = c.ref(av[i], bv[i]);
      // The inputs hold ties (eq is 1 somewhere: an eq giving all zeros
      // fails) and NaN on both sides.
      ASSERT_GE(std::count_if(av.begin(), av.end(), [](double v) { return std::isnan(v); }), 1);
      ASSERT_GE(std::count_if(bv.begin(), bv.end(), [](double v) { return std::isnan(v); }), 1);
      int64_t ties = 0;
      for (size_t i = 0; i < av.size(); ++i) ties += av[i] == bv[i];
      ASSERT_GE(ties, 9);
      // Backward rules of gelu are checked against a numeric derivative.
      const double tol = std::max(tolerance(dt), c.op == BinaryOp::gelu_tanh_backward ||
                                                         c.op == BinaryOp::gelu_erf_backward
                                                     ? 1e-6
                                                     : 0.0);
      EXPECT_LE(rel_error(host_f64(out), ref), tol);
    }
  }
}

TEST_F(OpsCpu, MixedDTypesPromote) {
  Tensor a = ones({3}, DType::f16), b = ones({3}, DType::bf16), c = ones({3}, DType::f64);
  EXPECT_EQ(prim::add(a, b).dtype(), DType::f32);
  EXPECT_EQ(prim::mul(a, c).dtype(), DType::f64);
  EXPECT_EQ(prim::add(a, a).dtype(), DType::f16);
  EXPECT_THROW(prim::add(ones({3}, DType::i64), ones({3}, DType::i64)), DTypeError);
}

TEST_F(OpsCpu, HalfArithmeticRoundsOnceFromF32) {
  SCOPED_TRACE(trace());
  for (DType dt : {DType::f16, DType::bf16}) {
    Tensor a = randn({1000}, dt), b = randn({1000}, dt);
    const auto got = prim::mul(a, b).to_vector<float>();
    const auto av = a.to_vector<float>(), bv = b.to_vector<float>();
    for (size_t i = 0; i < got.size(); ++i) {
      const float exact = av[i] * bv[i];
      const float rounded = dt == DType::f16 ? float(Half(exact)) : float(BFloat16(exact));
      ASSERT_EQ(got[i], rounded) << i;
    }
  }
  // Overflow to infinity, as on the GPU.
  Tensor big = full({2}, 300.0, DType::f16);
  EXPECT_TRUE(std::isinf(prim::mul(big, big).to_vector<float>()[0]));
}

TEST_F(OpsCpu, ReductionsOverAnyDims) {
  SCOPED_TRACE(trace());
  const Shape shape{3, 4, 5, 2};
  const std::vector<std::vector<int64_t>> dim_sets = {{}, {0}, {1}, {3}, {-1}, {1, 2}, {0, 2}, {0, 3}, {0, 1, 2, 3}};
  for (DType dt : kFloatTypes) {
    Tensor x = randn(shape, dt);
    const std::vector<double> xv = host_f64(x);
    for (const auto& dims : dim_sets) {
      for (bool keepdim : {false, true}) {
        SCOPED_TRACE(fmt::format("{} dims [{}] keepdim {}", dtype_name(dt), fmt::join(dims, ","), keepdim));
        std::vector<bool> red(4, dims.empty());
        for (int64_t d : dims) red[d < 0 ? d + 4 : d] = true;
        Shape kept;
        for (int d = 0; d < 4; ++d) kept.push_back(red[d] ? 1 : shape[d]);
        const int64_t n_out = numel(kept);
        std::vector<double> sum(n_out, 0), mx(n_out, -INFINITY), mn(n_out, INFINITY), cnt(n_out, 0);
        const Shape kst = contiguous_strides(kept), xst = contiguous_strides(shape);
        for (int64_t i = 0; i < numel(shape); ++i) {
          int64_t o = 0;
          for (int d = 0; d < 4; ++d) o += red[d] ? 0 : ((i / xst[d]) % shape[d]) * kst[d];
          sum[o] += xv[i];
          mx[o] = std::max(mx[o], xv[i]);
          mn[o] = std::min(mn[o], xv[i]);
          cnt[o] += 1;
        }
        std::vector<double> mean(n_out);
        for (int64_t i = 0; i < n_out; ++i) mean[i] = sum[i] / cnt[i];
        Tensor s = prim::sum(x, dims, keepdim);
        if (keepdim) EXPECT_EQ(s.shape(), kept);
        EXPECT_EQ(s.numel(), n_out);
        // Sums of n terms: the tolerance grows with the count.
        const double tol = tolerance(dt) * 8;
        EXPECT_LE(rel_error(host_f64(s), sum), tol);
        EXPECT_LE(rel_error(host_f64(prim::mean(x, dims, keepdim)), mean), tol);
        EXPECT_EQ(host_f64(prim::amax(x, dims, keepdim)), mx);
        EXPECT_EQ(host_f64(prim::amin(x, dims, keepdim)), mn);
      }
    }
  }
}

TEST_F(OpsCpu, ReductionOfNonContiguousInput) {
  SCOPED_TRACE(trace());
  Tensor x = prim::transpose(randn({6, 9}, DType::f64), 0, 1);  // [9, 6]
  const auto xv = host_f64(x);
  std::vector<double> ref(6, 0);
  for (int i = 0; i < 9; ++i)
    for (int j = 0; j < 6; ++j) ref[j] += xv[i * 6 + j];
  EXPECT_LE(rel_error(host_f64(prim::sum(x, {0})), ref), 1e-12);
}

TEST_F(OpsCpu, ArgmaxFindsFirstMaximumAndNaN) {
  SCOPED_TRACE(trace());
  Tensor x = randn({4, 7}, DType::f32);
  const auto xv = host_f64(x);
  const auto got = prim::argmax(x, 1).to_vector<int64_t>();
  for (int r = 0; r < 4; ++r) {
    int64_t best = 0;
    for (int c = 1; c < 7; ++c)
      if (xv[r * 7 + c] > xv[r * 7 + best]) best = c;
    EXPECT_EQ(got[r], best);
  }
  Tensor ties = from_vector({1.f, 3.f, 3.f, NAN, 2.f, 5.f}, {2, 3});
  EXPECT_EQ(prim::argmax(ties, 1).to_vector<int64_t>(), (std::vector<int64_t>{1, 0}));
  EXPECT_TRUE(std::isnan(prim::amax(ties).item()));
  EXPECT_EQ(prim::argmax(ties, 0, true).shape(), (Shape{1, 3}));
}

// An inner dimension of 0 gives zeros, also through the one-GEMM path of
// a 3-d operand (which views it as rows of length k).
TEST_F(OpsCpu, EmptyInnerDimensionMatmulIsZeros) {
  for (const Shape& a : {Shape{1, 1, 0}, Shape{2, 3, 0}, Shape{3, 0}}) {
    SCOPED_TRACE(shape_str(a));
    const Tensor out = prim::matmul(zeros(a), zeros({0, 4}));
    Shape want(a.begin(), a.end() - 1);
    want.push_back(4);
    EXPECT_EQ(out.shape(), want);
    for (double v : host_f64(out)) EXPECT_EQ(v, 0.0);
  }
}

// A convolution where a batch or a channel count is 0 gives the shapes of
// any other, its elements (if any) sums over nothing; a kernel of size 0 is
// refused.
TEST_F(OpsCpu, ConvolutionsOverNothingAreEmptyOrZeros) {
  const Conv2dParams p{1, 1, 1, 1};
  for (const auto& [xs, ws] : {std::pair<Shape, Shape>{{0, 3, 8, 8}, {4, 3, 3, 3}},
                               {{2, 0, 8, 8}, {4, 0, 3, 3}},
                               {{2, 3, 8, 8}, {0, 3, 3, 3}}}) {
    SCOPED_TRACE(shape_str(xs).str() + " * " + shape_str(ws).str());
    const Tensor x = mpt::randn(xs), w = mpt::randn(ws);
    const Tensor y = prim::conv2d(x, w, p);
    EXPECT_EQ(y.shape(), (Shape{xs[0], ws[0], 8, 8}));
    const Tensor dy = mpt::randn(y.shape());
    const Tensor dx = prim::conv2d_backward_data(dy, w, xs, p), dw = prim::conv2d_backward_weight(x, dy, ws, p);
    EXPECT_EQ(dx.shape(), xs);
    EXPECT_EQ(dw.shape(), ws);
    for (const Tensor& t : {y, dx, dw})
      for (double v : host_f64(t)) ASSERT_EQ(v, 0.0);
  }
  EXPECT_THROW(prim::conv2d(mpt::randn({1, 3, 8, 8}), mpt::randn({4, 3, 0, 3}), p), ShapeError);
}

// The CPU's 16-bit convolutions (and their gradients) accumulate in f32 and
// round once: within one unit in the last place of the exact f64 result,
// plus what f32 accumulation can lose to cancellation. Max pooling picks
// an input, so it is exact.
TEST(CpuSixteenBits, ConvolutionAndPoolingRoundOnceFromTheExactResult) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  const Conv2dParams p{1, 1, 1, 1};
  for (DType dt : {DType::f16, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    const double ulp = dt == DType::f16 ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7);
    const Tensor x = randn({2, 5, 9, 7}, dt, kCPU, &gen), w = randn({4, 5, 3, 3}, dt, kCPU, &gen);
    const Tensor dy = randn({2, 4, 9, 7}, dt, kCPU, &gen);
    const auto exact = [](const Tensor& t) { return prim::to(t, DType::f64); };
    const std::vector<std::pair<Tensor, Tensor>> results = {
        {prim::conv2d(x, w, p), prim::conv2d(exact(x), exact(w), p)},
        {prim::conv2d_backward_data(dy, w, x.shape(), p), prim::conv2d_backward_data(exact(dy), exact(w), x.shape(), p)},
        {prim::conv2d_backward_weight(x, dy, w.shape(), p),
         prim::conv2d_backward_weight(exact(x), exact(dy), w.shape(), p)}};
    for (size_t r = 0; r < results.size(); ++r) {
      const std::vector<double> got = host_f64(results[r].first), want = host_f64(results[r].second);
      for (size_t i = 0; i < want.size(); ++i)
        ASSERT_LE(std::fabs(got[i] - want[i]), ulp * std::fabs(want[i]) + 1e-4) << "result " << r << ", element " << i;
    }
    const Pool2dParams pool{3, 3, 2, 2, 1, 1};
    EXPECT_EQ(host_f64(prim::max_pool2d(x, pool).first), host_f64(prim::max_pool2d(exact(x), pool).first));
  }
}

// A 0-d tensor: reductions over its "dimension 0", and their gradients, as
// in PyTorch; squeeze leaves it alone.
TEST_F(OpsCpu, ScalarsReduceAndSqueezeOverDimensionZero) {
  const Tensor x = scalar_tensor(3.0);
  EXPECT_EQ(prim::sum(x, {0}).item(), 3.0);
  EXPECT_EQ(prim::squeeze(x, 0).dim(), 0);
}

TEST_F(OpsCpu, EmptyReductions) {
  Tensor e = zeros({0, 3});
  EXPECT_EQ(prim::sum(e, {0}).to_vector<float>(), (std::vector<float>{0, 0, 0}));
  EXPECT_TRUE(std::isnan(prim::mean(e, {0}).to_vector<float>()[0]));
  EXPECT_THROW(prim::amax(e, {0}), ShapeError);
}

// Naive f64 batched product over logical (contiguous) values.
std::vector<double> matmul_ref(const std::vector<double>& a, const std::vector<double>& b, int64_t batch_a,
                               int64_t batch_b, int64_t m, int64_t k, int64_t n) {
  const int64_t batch = std::max(batch_a, batch_b);
  std::vector<double> out(static_cast<size_t>(batch * m * n), 0);
  for (int64_t p = 0; p < batch; ++p)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (int64_t q = 0; q < k; ++q)
          s += a[(batch_a == 1 ? 0 : p) * m * k + i * k + q] * b[(batch_b == 1 ? 0 : p) * k * n + q * n + j];
        out[p * m * n + i * n + j] = s;
      }
  return out;
}

TEST_F(OpsCpu, MatmulLayoutsAndBatches) {
  SCOPED_TRACE(trace());
  for (DType dt : kFloatTypes) {
    SCOPED_TRACE(dtype_name(dt));
    const int64_t m = 17, k = 33, n = 9;
    // Plain, transposed operands, batched, broadcast batch, [B, T, C] @ [C, N].
    Tensor a = randn({m, k}, dt), b = randn({k, n}, dt);
    EXPECT_LE(rel_error(host_f64(prim::matmul(a, b)), matmul_ref(host_f64(a), host_f64(b), 1, 1, m, k, n)),
              tolerance(dt) * 4);
    Tensor at = prim::transpose(randn({k, m}, dt), 0, 1), bt = prim::transpose(randn({n, k}, dt), 0, 1);
    EXPECT_LE(rel_error(host_f64(prim::matmul(at, bt)), matmul_ref(host_f64(at), host_f64(bt), 1, 1, m, k, n)),
              tolerance(dt) * 4);
    Tensor ba = randn({3, m, k}, dt), bb = prim::transpose(randn({3, n, k}, dt), 1, 2);
    EXPECT_LE(rel_error(host_f64(prim::matmul(ba, bb)), matmul_ref(host_f64(ba), host_f64(bb), 3, 3, m, k, n)),
              tolerance(dt) * 4);
    Tensor bc = randn({1, k, n}, dt);
    Tensor out = prim::matmul(ba, bc);
    EXPECT_EQ(out.shape(), (Shape{3, m, n}));
    EXPECT_LE(rel_error(host_f64(out), matmul_ref(host_f64(ba), host_f64(bc), 3, 1, m, k, n)), tolerance(dt) * 4);
    Tensor x = randn({2, 5, k}, dt);
    Tensor y = prim::matmul(x, b);
    EXPECT_EQ(y.shape(), (Shape{2, 5, n}));
    EXPECT_LE(rel_error(host_f64(y), matmul_ref(host_f64(x), host_f64(b), 1, 1, 10, k, n)), tolerance(dt) * 4);
    // 4-d attention-like product with a permuted (non-foldable) operand.
    Tensor q = prim::permute(randn({2, 6, 3, 8}, dt), {0, 2, 1, 3});  // [2, 3, 6, 8]
    Tensor kk = prim::transpose(q, 2, 3);                             // [2, 3, 8, 6]
    Tensor s = prim::matmul(q, kk);
    EXPECT_EQ(s.shape(), (Shape{2, 3, 6, 6}));
    EXPECT_LE(rel_error(host_f64(s), matmul_ref(host_f64(q), host_f64(kk), 6, 6, 6, 8, 6)), tolerance(dt) * 4);
  }
}

// Products large enough to be split over the CPU's threads (by rows, or by
// columns where there are more of those), with a transposed operand, in
// f32 and through the widened 16-bit path. On one CPU nothing is split and
// the same checks hold.
TEST_F(OpsCpu, MatmulSplitOverThreadsMatchesReference) {
  SCOPED_TRACE(trace());
  for (DType dt : {DType::f32, DType::bf16}) {
    for (const auto& [m, n] : {std::pair<int64_t, int64_t>{520, 130}, {130, 520}}) {
      SCOPED_TRACE(fmt::format("{} [{}, 512] @ [512, {}]", dtype_name(dt), m, n));
      const int64_t k = 512;
      Tensor a = randn({m, k}, dt), b = prim::transpose(randn({n, k}, dt), 0, 1);
      EXPECT_LE(rel_error(host_f64(prim::matmul(a, b)), matmul_ref(host_f64(a), host_f64(b), 1, 1, m, k, n)),
                tolerance(dt) * 4);
    }
  }
}

// Reductions large enough to be split over threads, on each of their three
// layouts: contiguous runs (inner 1, a length not a multiple of the
// partial sums' 8), many blocks, and few blocks of many columns. Values
// from a small set give ties, and a few NaN must win max, min and argmax.
// Long sums stay accurate: f32 accumulators that add millions of terms one
// after another drift (a running total of 5e4 rounds each added 0.01 to a
// multiple of 0.0039). Summed by halves above a few thousand terms, the
// error grows with the log of the length, as in PyTorch's cascade sum.
TEST_F(OpsCpu, LongSumsStayAccurateAlongEitherLayout) {
  const double value = 0.01;
  const double stored = static_cast<double>(static_cast<float>(value));
  const int64_t n = 40'000'000;
  const Tensor x = full({n}, value);
  EXPECT_NEAR(prim::sum(x).item(), n * stored, 1e-5 * n * stored);
  EXPECT_NEAR(prim::mean(x).item(), stored, 1e-5 * stored);
  // Along dimension 0 of [k, 4]: each output walks a strided column.
  const int64_t k = 4'000'000;
  const std::vector<double> columns = host_f64(prim::sum(full({k, 4}, value), {0}));
  for (double c : columns) EXPECT_NEAR(c, k * stored, 1e-5 * k * stored);
}

TEST_F(OpsCpu, ReductionsSplitOverThreadsMatchReference) {
  SCOPED_TRACE(trace());
  for (DType dt : {DType::f32, DType::bf16}) {
    for (const Shape& shape : {Shape{300, 1001}, Shape{400, 37, 9}, Shape{2, 300, 700}}) {
      // Reduce dim 1 of [outer, k(, inner)].
      const int64_t outer = shape[0], k = shape[1], inner = shape.size() == 3 ? shape[2] : 1;
      SCOPED_TRACE(fmt::format("{} [{}, {}, {}]", dtype_name(dt), outer, k, inner));
      std::vector<double> xv = small_integers(shape);
      for (size_t i = 7; i < xv.size(); i += 9973) xv[i] = NAN;
      const Tensor x = from_vector(xv, shape, dt);
      std::vector<double> sum(outer * inner, 0), mx(outer * inner), mn(outer * inner);
      std::vector<int64_t> arg(outer * inner, 0);
      for (int64_t o = 0; o < outer; ++o)
        for (int64_t i = 0; i < inner; ++i) {
          const auto at = [&](int64_t j) { return xv[static_cast<size_t>((o * k + j) * inner + i)]; };
          double& m = mx[o * inner + i];
          double& n = mn[o * inner + i];
          m = n = at(0);
          for (int64_t j = 0; j < k; ++j) {
            sum[o * inner + i] += at(j);
            if (!std::isnan(m) && (at(j) > m || std::isnan(at(j)))) {
              m = at(j);
              arg[o * inner + i] = j;
            }
            if (!std::isnan(n) && (at(j) < n || std::isnan(at(j)))) n = at(j);
          }
        }
      const auto same = [](const std::vector<double>& got, const std::vector<double>& want) {
        for (size_t i = 0; i < want.size(); ++i)
          if (!(got[i] == want[i] || (std::isnan(got[i]) && std::isnan(want[i])))) return ::testing::AssertionFailure() << "at " << i << ": " << got[i] << " against " << want[i];
        return ::testing::AssertionSuccess();
      };
      EXPECT_TRUE(same(host_f64(prim::amax(x, {1})), mx));
      EXPECT_TRUE(same(host_f64(prim::amin(x, {1})), mn));
      EXPECT_EQ(prim::argmax(x, 1).to_vector<int64_t>(), arg);
      // Integers summed in f32 are exact, so the NaN-free sums must be
      // exact too; the 16-bit result then rounds once.
      const std::vector<double> got = host_f64(prim::sum(x, {1}));
      for (size_t i = 0; i < sum.size(); ++i) {
        if (std::isnan(sum[i])) {
          EXPECT_TRUE(std::isnan(got[i])) << i;
        } else {
          ASSERT_EQ(got[i], host_f64(from_vector(std::vector<double>{sum[i]}, {1}, dt))[0]) << i;
        }
      }
    }
  }
}

// Pooling windows with ties and NaN, padded and overlapping, across enough
// planes to be split over threads: a NaN wins its window, otherwise the
// first maximum in (row, column) order does, as in PyTorch; the indices
// say which.
TEST_F(OpsCpu, MaxPool2dPicksTheFirstMaximumAndNaN) {
  SCOPED_TRACE(trace());
  // {kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w}
  for (const Pool2dParams& p : {Pool2dParams{}, Pool2dParams{3, 3, 1, 1, 1, 1}, Pool2dParams{3, 2, 2, 3, 1, 1}}) {
    for (DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(fmt::format("{} kernel {}x{} stride ({}, {}) pad ({}, {})", dtype_name(dt), p.kernel_h, p.kernel_w,
                               p.stride_h, p.stride_w, p.pad_h, p.pad_w));
      for (int64_t w : {14, 15}) {
        SCOPED_TRACE(fmt::format("width {}", w));
        const int64_t planes = 96 * 16, h = 13;
        std::vector<double> xv = small_integers({planes, h, w});
        // NaNs alone, and two in one window (the first one's index wins).
        for (size_t i = 5; i < xv.size(); i += 613) xv[i] = NAN;
        for (size_t i = 300; i + 1 < xv.size(); i += 1229) xv[i] = xv[i + 1] = NAN;
        const Tensor x = from_vector(xv, {96, 16, h, w}, dt);
        const auto [out, indices] = prim::max_pool2d(x, p);
        const int64_t ho = out.shape()[2], wo = out.shape()[3];
        const std::vector<double> got = host_f64(out);
        const std::vector<int64_t> got_at = indices.to_vector<int64_t>();
        for (int64_t pl = 0; pl < planes; ++pl)
          for (int64_t oy = 0; oy < ho; ++oy)
            for (int64_t ox = 0; ox < wo; ++ox) {
              int64_t best = -1;
              for (int64_t ky = 0; ky < p.kernel_h; ++ky)
                for (int64_t kx = 0; kx < p.kernel_w; ++kx) {
                  const int64_t y = oy * p.stride_h - p.pad_h + ky, xx = ox * p.stride_w - p.pad_w + kx;
                  if (y < 0 || y >= h || xx < 0 || xx >= w) continue;
                  const double v = xv[static_cast<size_t>(pl * h * w + y * w + xx)];
                  const double b = best < 0 ? 0 : xv[static_cast<size_t>(pl * h * w + best)];
                  if (best < 0 || (!std::isnan(b) && (v > b || std::isnan(v)))) best = y * w + xx;
                }
              const auto k = static_cast<size_t>((pl * ho + oy) * wo + ox);
              ASSERT_EQ(got_at[k], best) << "plane " << pl << " output (" << oy << ", " << ox << ")";
              const double want = xv[static_cast<size_t>(pl * h * w + best)];
              ASSERT_TRUE(got[k] == want || (std::isnan(got[k]) && std::isnan(want))) << got[k] << " against " << want;
            }
      }
    }
  }
}

TEST(CpuThreads, ParallelForCoversEveryIndexOnceAndRethrows) {
  EXPECT_GE(cpu::cpu_threads(), 1);
  for (const auto& sizes : {std::tuple<int64_t, int64_t, int64_t>{1000, 16, 1}, {7, 16, 1}, {100000, 1, 1000},
                            {0, 4, 1}}) {
    // Plain variables, not a structured binding: the lambda below takes them.
    const int64_t count = std::get<0>(sizes), grain = std::get<1>(sizes), min_grains = std::get<2>(sizes);
    std::vector<std::atomic<int>> seen(static_cast<size_t>(count));
    std::atomic<int> pieces{0};
    cpu::parallel_for(count, grain, min_grains, [&](int64_t begin, int64_t end) {
      ++pieces;
      EXPECT_LT(begin, end);
      EXPECT_TRUE(begin % grain == 0) << begin;
      for (int64_t i = begin; i < end; ++i) ++seen[static_cast<size_t>(i)];
    });
    for (int64_t i = 0; i < count; ++i) ASSERT_EQ(seen[static_cast<size_t>(i)].load(), 1) << "index " << i;
    EXPECT_LE(pieces.load(), std::max(1, cpu::cpu_threads()));
  }
  // A piece that splits its own work, and callers on several threads at
  // once: the pool serves one caller, the others run their pieces
  // themselves, and every index is still visited once.
  std::vector<std::atomic<int>> nested(1 << 12);
  cpu::parallel_for(1 << 6, 1, 1, [&](int64_t begin, int64_t end) {
    for (int64_t outer = begin; outer < end; ++outer)
      cpu::parallel_for(1 << 6, 1, 1, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) ++nested[static_cast<size_t>((outer << 6) + i)];
      });
  });
  std::vector<std::atomic<int>> concurrent(4 << 16);
  {
    std::vector<std::jthread> callers;
    for (int64_t c = 0; c < 4; ++c)
      callers.emplace_back([&, c] {
        cpu::parallel_for(1 << 16, 64, 1, [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) ++concurrent[static_cast<size_t>((c << 16) + i)];
        });
      });
  }
  for (const auto& counts : {&nested, &concurrent})
    for (size_t i = 0; i < counts->size(); ++i) ASSERT_EQ((*counts)[i].load(), 1) << "index " << i;
  EXPECT_THROW(cpu::parallel_for(1 << 20, 1, 1,
                                 [](int64_t, int64_t end) {
                                   if (end == int64_t{1} << 20) throw ValueError("the last piece failed");
                                 }),
               ValueError);
}

// A child forked after the pool was made has none of its threads: its
// splits run on its own thread and complete (bounded: a child that hangs
// is killed and fails the test).
TEST(CpuThreads, AForkedChildRunsItsSplitsItself) {
  cpu::parallel_for(1 << 20, 1, 1, [](int64_t, int64_t) {});  // the pool exists where there are threads
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::vector<int> seen(1 << 16, 0);
    cpu::parallel_for(1 << 16, 64, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) ++seen[static_cast<size_t>(i)];
    });
    ::_exit(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }) ? 0 : 1);
  }
  int status = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (::waitpid(child, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > until) {
      ::kill(child, SIGKILL);
      ::waitpid(child, &status, 0);
      FAIL() << "the forked child's parallel_for did not finish in 20 s";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
}

TEST_F(OpsCpu, MatmulErrorsNameTheShapes) {
  try {
    prim::matmul(zeros({2, 3}), zeros({4, 5}));
    FAIL();
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("matmul: inner dimensions differ: f32[2, 3] on cpu @ f32[4, 5] on cpu"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(prim::matmul(zeros({3}), zeros({3, 2})), ShapeError);
  EXPECT_THROW(prim::matmul(zeros({2, 3}), zeros({3, 2}, DType::f16)), DTypeError);
  try {
    prim::add(zeros({2, 3}), zeros({4}));
    FAIL();
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("add: shapes [2, 3] and [4] do not broadcast"), std::string::npos)
        << e.what();
  }
}

TEST_F(OpsCpu, CopyCastsBetweenAllDTypesAndLayouts) {
  SCOPED_TRACE(trace());
  Tensor src = rand({4, 6}, DType::f64, -100, 100);
  const auto sv = host_f64(src);
  for (DType to : kAllDTypes) {
    if (to == DType::u8) continue;  // negative values
    Tensor c = prim::to(src, to);
    const auto cv = host_f64(c);
    for (size_t i = 0; i < sv.size(); ++i) {
      double expect = sv[i];
      if (to == DType::f32) expect = static_cast<float>(sv[i]);
      if (to == DType::f16) expect = float(Half(sv[i]));
      if (to == DType::bf16) expect = float(BFloat16(sv[i]));
      if (to == DType::e4m3) expect = float(Float8E4M3(sv[i]));
      if (to == DType::e5m2) expect = float(Float8E5M2(sv[i]));
      if (to == DType::i32 || to == DType::i64) expect = std::trunc(sv[i]);
      ASSERT_EQ(cv[i], expect) << dtype_name(to) << " element " << i;
    }
  }
  // Strided destination, broadcast source.
  Tensor dst = zeros({6, 4}, DType::f16);
  Tensor dst_t = prim::transpose(dst, 0, 1);  // [4, 6]
  prim::copy_(dst_t, prim::view(arange(0, 6, 1, DType::f64), {1, 6}));
  const auto dv = host_f64(dst);
  for (int r = 0; r < 6; ++r)
    for (int c = 0; c < 4; ++c) EXPECT_EQ(dv[r * 4 + c], r);
  EXPECT_THROW(prim::copy_(zeros({2, 2}), zeros({3})), ShapeError);
}

// A strided copy within one dtype moves the bits, NaN payloads and signs
// included, as the GPU's does.
TEST_F(OpsCpu, StridedCopiesOfOneDTypeKeepEveryBit) {
  const std::vector<Half> h = {Half::from_bits(0x7C01), Half::from_bits(0xFE00), Half::from_bits(0x3C00),
                               Half::from_bits(0x7FFF)};
  const Tensor t = prim::contiguous(prim::transpose(from_vector(h, {2, 2}, DType::f16), 0, 1));
  const Half* p = t.data<Half>();
  EXPECT_EQ(p[0].bits, 0x7C01);
  EXPECT_EQ(p[1].bits, 0x3C00);
  EXPECT_EQ(p[2].bits, 0xFE00);
  EXPECT_EQ(p[3].bits, 0x7FFF);
}

TEST_F(OpsCpu, IntegerCopiesKeepEveryBit) {
  const int64_t big = (int64_t{1} << 60) + 1;  // not representable in f64
  Tensor src = from_vector(std::vector<int64_t>{big, -big, 7, 8}, {2, 2}, DType::i64);
  EXPECT_EQ(prim::contiguous(prim::transpose(src, 0, 1)).to_vector<int64_t>(),
            (std::vector<int64_t>{big, 7, -big, 8}));
}

TEST_F(OpsCpu, FillAndArange) {
  Tensor t = full({2, 3}, 7.5, DType::bf16);
  EXPECT_EQ(host_f64(t), std::vector<double>(6, 7.5));
  EXPECT_EQ(host_f64(arange(2, 5, 0.5)), (std::vector<double>{2, 2.5, 3, 3.5, 4, 4.5}));
  EXPECT_EQ(arange(0, 10, 3, DType::i64).to_vector<int64_t>(), (std::vector<int64_t>{0, 3, 6, 9}));
  EXPECT_EQ(arange(5, 0, -2).to_vector<float>(), (std::vector<float>{5, 3, 1}));
  EXPECT_EQ(arange(0, 0).numel(), 0);
}

TEST_F(OpsCpu, OperandsOnDifferentDevicesAreRefused) {
  // Two virtual CPU devices share memory but are distinct devices.
  Tensor a = zeros({2});
  Tensor b = Tensor::view_of(Storage::allocate(8, Device("cpu:1")), {2}, {1}, 0, DType::f32);
  try {
    prim::add(a, b);
    FAIL();
  } catch (const DeviceError& e) {
    EXPECT_NE(std::string(e.what()).find("add: operands are on different devices: f32[2] on cpu and f32[2] on cpu:1"),
              std::string::npos)
        << e.what();
  }
  // Copies between them work.
  prim::copy_(b, full({2}, 3.0));
  EXPECT_EQ(host_f64(prim::to(b, kCPU)), (std::vector<double>{3, 3}));
}

// A tensor of random bit patterns: NaNs of both signs, infinities,
// subnormals and zeros turn up among them.
Tensor random_bits(DType dt, int64_t n, std::mt19937_64& rng) {
  const Tensor t = Tensor::empty({n}, dt);
  auto* bytes = static_cast<unsigned char*>(t.data_ptr());
  for (size_t i = 0; i < t.nbytes(); ++i) bytes[i] = static_cast<unsigned char>(rng());
  return t;
}

// The index of the first element whose bytes differ (elements `stride`
// apart in `b`), or -1.
int64_t first_differing(const Tensor& a, const Tensor& b, int64_t stride) {
  const size_t size = dtype_size(a.dtype());
  const auto* pa = static_cast<const unsigned char*>(a.data_ptr());
  const auto* pb = static_cast<const unsigned char*>(b.data_ptr());
  for (int64_t i = 0; i < a.numel(); ++i)
    if (std::memcmp(pa + i * size, pb + i * stride * size, size) != 0) return i;
  return -1;
}

const DType kCastDTypes[] = {DType::f32, DType::f16, DType::bf16};

// Dense casts between f32, f16 and bf16 run split over the threads in
// loops that vectorize; a copy into a strided destination goes element by
// element through the generic loop. Every pair must agree bit for bit on
// every kind of value (signalling NaNs stay signalling in both).
TEST(CpuCasts, DenseCastsMatchTheElementLoopBitForBit) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const int64_t n = 5 * cpu::kMinElementsPerPiece + 777;  // several pieces, a ragged last one
  for (DType from : kCastDTypes)
    for (DType to : kCastDTypes) {
      if (from == to) continue;
      SCOPED_TRACE(fmt::format("{} -> {}", dtype_name(from), dtype_name(to)));
      const Tensor src = random_bits(from, n, rng);
      const Tensor dense = Tensor::empty({n}, to);
      prim::copy_(dense, src);
      const Tensor every_other = Tensor::empty({2 * n}, to);
      prim::copy_(prim::slice(every_other, 0, 0, 2 * n, 2), src);
      EXPECT_EQ(first_differing(dense, every_other, 2), -1);
    }
}

// 16-bit GELU (both forms) runs through tables of every input's result:
// for each of the 65536 bit patterns, forward and backward must give the
// bits of the f32 rule on the widened operands, rounded once (NaN as NaN),
// as the computation they replace did; a strided view still computes.
TEST(CpuElementwise, SixteenBitGeluIsTheF32RuleRoundedOnceForEveryInput) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const int64_t n = int64_t{1} << 16;
  // The same bits, or NaN in both.
  auto expect_same = [n](const Tensor& got, const Tensor& want, const char* what) {
    const auto* a = static_cast<const uint16_t*>(got.data_ptr());
    const auto* b = static_cast<const uint16_t*>(want.data_ptr());
    const std::vector<float> a32 = prim::to(got, DType::f32).to_vector<float>();
    const std::vector<float> b32 = prim::to(want, DType::f32).to_vector<float>();
    int64_t differing = 0;
    for (int64_t i = 0; i < n; ++i) {
      const auto k = static_cast<size_t>(i);
      if (a[i] != b[i] && !(std::isnan(a32[k]) && std::isnan(b32[k])) && differing++ < 5)
        ADD_FAILURE() << what << ", input bits " << i << ": " << a[i] << " against " << b[i];
    }
    EXPECT_EQ(differing, 0) << what;
  };
  for (DType dt : {DType::bf16, DType::f16})
    for (auto [forward, backward] : {std::pair{UnaryOp::gelu_erf, BinaryOp::gelu_erf_backward},
                                     {UnaryOp::gelu_tanh, BinaryOp::gelu_tanh_backward}}) {
      SCOPED_TRACE(fmt::format("{} {}", dtype_name(dt), unary_op_name(forward)));
      const Tensor x = Tensor::empty({n}, dt);
      auto* bits = static_cast<uint16_t*>(x.data_ptr());
      for (int64_t i = 0; i < n; ++i) bits[i] = static_cast<uint16_t>(i);
      const Tensor g = prim::to(prim::mul_scalar(randn({n}), 3.0), dt);
      const Tensor x32 = prim::to(x, DType::f32), g32 = prim::to(g, DType::f32);
      const Tensor y = prim::unary(forward, x);
      expect_same(y, prim::to(prim::unary(forward, x32), dt), "forward");
      expect_same(prim::binary(backward, g, x), prim::to(prim::binary(backward, g32, x32), dt), "backward");
      // Every other element of a longer tensor: the computing loop.
      const Tensor spread = Tensor::empty({2 * n}, dt);
      prim::copy_(prim::slice(spread, 0, 0, 2 * n, 2), x);
      expect_same(prim::contiguous(prim::unary(forward, prim::slice(spread, 0, 0, 2 * n, 2))), y, "strided forward");
    }
}

// scaled_copy_list_ on the CPU: each element is x * scale in f32, rounded
// once to the destination (a scale of 1 casts as copy_ does), over a list
// of tensors small and large whose elements are split over the threads as
// one range (pieces start and end inside tensors, some tensors are empty).
TEST(CpuCasts, ScaledCopyListRoundsEachProductOnce) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const std::vector<int64_t> sizes = {0, 1, 1000, 70001, 0, 3 * cpu::kMinElementsPerPiece + 5, 17};
  for (DType from : kCastDTypes)
    for (DType to : kCastDTypes)
      for (double scale : {1.0, 0.25, 65536.0 * 3}) {
        SCOPED_TRACE(fmt::format("{} -> {}, scale {}", dtype_name(from), dtype_name(to), scale));
        std::vector<Tensor> srcs, dsts;
        for (int64_t size : sizes) {
          srcs.push_back(random_bits(from, size, rng));
          dsts.push_back(Tensor::empty({size}, to));
        }
        prim::scaled_copy_list_(dsts, srcs, scale);
        for (size_t t = 0; t < sizes.size(); ++t) {
          Tensor expected = Tensor::empty({sizes[t]}, to);
          if (scale == 1.0) {
            prim::copy_(expected, srcs[t]);
          } else {
            // The product in f32 on the host, rounded once by the host's cast.
            const Tensor product = Tensor::empty({sizes[t]}, DType::f32);
            prim::copy_(product, srcs[t]);
            float* p = product.data<float>();
            for (int64_t i = 0; i < sizes[t]; ++i) p[i] *= static_cast<float>(scale);
            prim::copy_(expected, product);
          }
          EXPECT_EQ(first_differing(dsts[t], expected, 1), -1) << "tensor " << t << " of " << sizes[t];
        }
      }
}

}  // namespace
}  // namespace mpt
