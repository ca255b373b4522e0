// Fused attention on the CPU (tensor/cpu/cpu_attention.cpp) against the
// composed math in f64 on fresh random inputs: output and the gradients of
// q, k and v, with and without the causal mask, lengths that no block of queries divides, head sizes from 1 to 128, the
// three dtypes it takes; q, k and v read in place from one projection as a
// GPT block cuts them; a later key never reaching an earlier query.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "autograd/engine.h"
#include "autograd/ops.h"
#include "tensor/ops.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

using testing::all_finite;
using testing::host_f64;

struct AttentionResult {
  std::vector<double> out, grad_q, grad_k, grad_v;
};

// Attention of q, k, v (converted to `dtype` from the given values, then
// differentiated) and the gradients of sum(out * weight).
AttentionResult attend(const Tensor& q0, const Tensor& k0, const Tensor& v0, const Tensor& weight, DType dtype,
                       bool causal) {
  // Fresh leaves each call (prim::to returns its input where the dtype
  // matches, whose gradient would accumulate).
  auto leaf = [dtype](const Tensor& t) { return prim::clone(prim::to(t, dtype)).set_requires_grad(true); };
  const Tensor q = leaf(q0), k = leaf(k0), v = leaf(v0);
  const Tensor out = scaled_dot_product_attention(q, k, v, causal);
  backward(sum(mul(out, prim::to(weight, dtype))));
  return {host_f64(out), host_f64(q.grad()), host_f64(k.grad()), host_f64(v.grad())};
}

// For each element of the output and of the three gradients, the sum of
// the magnitudes of the terms that make it, in f64 (dO = weight, delta_i =
// dO_i . O_i, dP_ij = dO_i . V_j, dS_ij = P_ij (dP_ij - delta_i)): P |V|
// for the output, P^T |dO| for dV, and P (|dO| . |V| + |dO| . P |V|) times
// |K| or |Q| for dQ and dK. Rounding errors scale with these, not with the
// results, which can cancel to far less (to 0 where one key is all there
// is; a head of size 1 over 5 keys). Equal lengths of queries and keys
// where causal.
AttentionResult magnitudes(const Tensor& q0, const Tensor& k0, const Tensor& v0, const Tensor& weight, bool causal) {
  const std::vector<double> q = host_f64(q0), k = host_f64(k0), v = host_f64(v0), dout = host_f64(weight);
  const int64_t heads = q0.shape()[0] * q0.shape()[1], tq = q0.shape()[2], tk = k0.shape()[2], d = q0.shape()[3];
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  AttentionResult m{std::vector<double>(q.size()), std::vector<double>(q.size()), std::vector<double>(k.size()),
                    std::vector<double>(v.size())};
  auto row_q = [&](int64_t hd, int64_t i) { return static_cast<size_t>((hd * tq + i) * d); };
  auto row_k = [&](int64_t hd, int64_t j) { return static_cast<size_t>((hd * tk + j) * d); };
  auto dot = [&](const std::vector<double>& a, size_t ia, const std::vector<double>& b, size_t ib) {
    double sum = 0;
    for (int64_t x = 0; x < d; ++x) sum += a[ia + x] * b[ib + x];
    return sum;
  };
  std::vector<double> p(static_cast<size_t>(tk));
  for (int64_t hd = 0; hd < heads; ++hd)
    for (int64_t i = 0; i < tq; ++i) {
      const size_t qi = row_q(hd, i);
      const int64_t keys = causal ? i + 1 : tk;
      double top = -INFINITY, total = 0;
      for (int64_t j = 0; j < keys; ++j) top = std::max(top, scale * dot(q, qi, k, row_k(hd, j)));
      for (int64_t j = 0; j < keys; ++j) total += p[j] = std::exp(scale * dot(q, qi, k, row_k(hd, j)) - top);
      for (int64_t j = 0; j < keys; ++j) {
        p[j] /= total;
        for (int64_t x = 0; x < d; ++x) m.out[qi + x] += p[j] * std::fabs(v[row_k(hd, j) + x]);
      }
      double delta_size = 0;
      for (int64_t x = 0; x < d; ++x) delta_size += std::fabs(dout[qi + x]) * m.out[qi + x];
      for (int64_t j = 0; j < keys; ++j) {
        const size_t kj = row_k(hd, j);
        double dp_size = 0;
        for (int64_t x = 0; x < d; ++x) dp_size += std::fabs(dout[qi + x] * v[kj + x]);
        const double a = p[j] * (dp_size + delta_size);
        for (int64_t x = 0; x < d; ++x) {
          m.grad_q[qi + x] += scale * a * std::fabs(k[kj + x]);
          m.grad_k[kj + x] += scale * a * std::fabs(q[qi + x]);
          m.grad_v[kj + x] += p[j] * std::fabs(dout[qi + x]);
        }
      }
    }
  return m;
}

// ||got - want|| over ||magnitude||.
double error_over_magnitude(const std::vector<double>& got, const std::vector<double>& want,
                            const std::vector<double>& magnitude) {
  double error = 0, size = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    error += (got[i] - want[i]) * (got[i] - want[i]);
    size += magnitude[i] * magnitude[i];
  }
  return std::sqrt(error) / std::sqrt(size);
}

TEST(CpuAttention, MatchesTheComposedMathInF64) {
  struct Case {
    int64_t b, h, tq, tk, d;
  };
  const Case cases[] = {{2, 3, 64, 64, 16}, {1, 2, 130, 130, 64}, {2, 1, 5, 5, 1},  {1, 2, 3, 3, 8},
                        {1, 1, 1, 1, 32},   {1, 2, 260, 260, 128}, {3, 2, 65, 65, 7}};
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (const Case& c : cases)
      for (bool causal : {true, false}) {
        const uint64_t seed = testing::fresh_seed();
        SCOPED_TRACE(::testing::Message() << "seed " << seed << " " << dtype_name(dt) << " [" << c.b << ", " << c.h
                                          << ", " << c.tq << "/" << c.tk << ", " << c.d << "]"
                                          << (causal ? " causal" : ""));
        Generator gen(seed);
        // Inputs rounded to the dtype first, so that the f64 reference sees
        // the very values the kernel reads.
        auto input = [&](int64_t t) { return prim::to(randn({c.b, c.h, t, c.d}, dt, kCPU, &gen), DType::f64); };
        const Tensor q = input(c.tq), k = input(c.tk), v = input(c.tk);
        const Tensor weight = prim::to(randn({c.b, c.h, c.tq, c.d}, dt, kCPU, &gen), DType::f64);
        ASSERT_TRUE(prim::fused_attention_available(prim::to(q, dt), prim::to(k, dt), prim::to(v, dt)));
        const AttentionResult fused = attend(q, k, v, weight, dt, causal);
        const AttentionResult exact = attend(q, k, v, weight, DType::f64, causal);
        const AttentionResult size = magnitudes(q, k, v, weight, causal);
        // f32: the sums' rounding; bf16 and f16: the output's and the
        // gradients' own rounding (2^-8, 2^-11), and the backward's delta
        // from the rounded output, against the f64 reference's unrounded
        // values; each relative to the magnitude of its terms.
        const double tol = dt == DType::f32 ? 2e-6 : dt == DType::f16 ? 1e-3 : 8e-3;
        ASSERT_TRUE(all_finite(fused.out));
        EXPECT_LE(error_over_magnitude(fused.out, exact.out, size.out), tol);
        EXPECT_LE(error_over_magnitude(fused.grad_q, exact.grad_q, size.grad_q), 2 * tol);
        EXPECT_LE(error_over_magnitude(fused.grad_k, exact.grad_k, size.grad_k), 2 * tol);
        EXPECT_LE(error_over_magnitude(fused.grad_v, exact.grad_v, size.grad_v), 2 * tol);
      }
}

TEST(CpuAttention, F64KeepsTheComposedMath) {
  // The kernel's row statistics are f32, too coarse for f64 gradient checks.
  const Tensor t = zeros({1, 1, 4, 8}, DType::f64, kCPU);
  EXPECT_FALSE(prim::fused_attention_available(t, t, t));
}

// q, k, v as CausalSelfAttention cuts them from one [B, T, 3C] projection:
// strided views read in place, the same bits as contiguous copies of them,
// and the gradient of the projection the same as of the copies.
TEST(CpuAttention, ReadsQkvInPlaceFromOneProjection) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  const int64_t B = 2, T = 100, H = 3, D = 16;
  for (DType dt : {DType::f32, DType::bf16}) {
    const Tensor qkv0 = randn({B, T, 3 * H * D}, dt, kCPU, &gen), weight = randn({B, H, T, D}, dt, kCPU, &gen);
    auto run = [&](bool copies) {
      const Tensor qkv = prim::clone(qkv0).set_requires_grad(true);
      std::vector<Tensor> parts = split(qkv, H * D, 2);
      for (Tensor& p : parts) {
        p = transpose(reshape(p, {B, T, H, D}), 1, 2);
        if (copies) p = contiguous(p);
      }
      const Tensor out = scaled_dot_product_attention(parts[0], parts[1], parts[2], true);
      backward(sum(mul(out, weight)));
      return std::make_pair(host_f64(out), host_f64(qkv.grad()));
    };
    const auto in_place = run(false), copied = run(true);
    EXPECT_EQ(in_place.first, copied.first) << dtype_name(dt);
    EXPECT_EQ(in_place.second, copied.second) << dtype_name(dt);
  }
}

// Under the causal mask a change to key/value j reaches only queries at j
// and after, across the kernel's blocks of queries.
TEST(CpuAttention, CausalQueriesNeverSeeALaterKey) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  const int64_t T = 300;
  for (DType dt : {DType::f32, DType::bf16}) {
    const Tensor q = randn({1, 2, T, 8}, dt, kCPU, &gen), k = randn({1, 2, T, 8}, dt, kCPU, &gen);
    const Tensor v = randn({1, 2, T, 8}, dt, kCPU, &gen);
    ASSERT_TRUE(prim::fused_attention_available(q, k, v));
    const Tensor changed_v = prim::clone(v), changed_k = prim::clone(k);
    prim::fill_(prim::slice(changed_v, 2, 200, 201), 100.0);
    prim::fill_(prim::slice(changed_k, 2, 200, 201), 100.0);
    const Tensor before = scaled_dot_product_attention(q, k, v, true);
    const Tensor after = scaled_dot_product_attention(q, changed_k, changed_v, true);
    EXPECT_EQ(host_f64(prim::slice(before, 2, 0, 200)), host_f64(prim::slice(after, 2, 0, 200)));
    EXPECT_NE(host_f64(prim::slice(before, 2, 200, T)), host_f64(prim::slice(after, 2, 200, T)));
  }
}

TEST(CpuAttention, SameBitsEveryRun) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  // Enough pairs and keys that the work splits over the backend's threads.
  const Tensor q = randn({4, 8, 256, 64}, DType::f32, kCPU, &gen), k = randn({4, 8, 256, 64}, DType::f32, kCPU, &gen);
  const Tensor v = randn({4, 8, 256, 64}, DType::f32, kCPU, &gen), w = randn({4, 8, 256, 64}, DType::f32, kCPU, &gen);
  const AttentionResult first = attend(q, k, v, w, DType::f32, true), second = attend(q, k, v, w, DType::f32, true);
  EXPECT_EQ(first.out, second.out);
  EXPECT_EQ(first.grad_q, second.grad_q);
  EXPECT_EQ(first.grad_k, second.grad_k);
  EXPECT_EQ(first.grad_v, second.grad_v);
}

}  // namespace
}  // namespace mpt
