#pragma once
// Finite-difference gradient checks in f64: the analytic gradient of
// L = sum(f(inputs) * R), for a fixed random R, against central differences.
#include <gtest/gtest.h>

#include <functional>

#include "autograd/ops.h"
#include "tests/test_util.h"

namespace mpt::testing {

using Fn = std::function<Tensor(const std::vector<Tensor>&)>;

// Inputs must be f64 leaves with requires_grad set (they may be views).
// The forward value and both gradients must be finite: rel_error would pass
// NaN against NaN.
inline void expect_gradients_match(const Fn& f, std::vector<Tensor> inputs, double tol = 1e-6, double h = 1e-6) {
  Generator gen(fresh_seed());
  Tensor out = f(inputs);
  ASSERT_EQ(out.dtype(), DType::f64);
  ASSERT_TRUE(all_finite(host_f64(out))) << "forward value";
  const Tensor weights = randn(out.shape(), DType::f64, out.device(), &gen);
  auto loss_value = [&]() {
    NoGradGuard no_grad;
    return prim::sum(prim::mul(f(inputs), weights)).item();
  };
  for (Tensor& x : inputs) x.set_grad(Tensor());
  backward(sum(mul(out, weights)));
  for (size_t i = 0; i < inputs.size(); ++i) {
    Tensor& x = inputs[i];
    if (!x.requires_grad()) continue;
    SCOPED_TRACE(::testing::Message() << "input " << i << " " << describe(x));
    ASSERT_TRUE(x.grad().defined()) << "no gradient reached input " << i;
    ASSERT_EQ(x.grad().shape(), x.shape());
    const std::vector<double> analytic = host_f64(x.grad());
    ASSERT_TRUE(all_finite(analytic)) << "analytic gradient";
    // Perturb each element in place through a contiguous view of the
    // logical positions (x may be a non-contiguous view of its storage).
    std::vector<double> numeric(analytic.size());
    const Shape st = x.strides();
    for (int64_t k = 0; k < x.numel(); ++k) {
      int64_t off = x.offset(), rem = k;
      for (int64_t d = x.dim() - 1; d >= 0; --d) {
        off += (rem % x.shape()[d]) * st[d];
        rem /= x.shape()[d];
      }
      double* p = static_cast<double*>(x.storage()->data()) + off;
      const double saved = *p;
      *p = saved + h;
      const double up = loss_value();
      *p = saved - h;
      const double down = loss_value();
      *p = saved;
      numeric[k] = (up - down) / (2 * h);
    }
    ASSERT_TRUE(all_finite(numeric)) << "numeric gradient";
    EXPECT_LE(rel_error(analytic, numeric), tol);
  }
}

// A random f64 leaf; `transposed` makes it a non-contiguous view.
inline Tensor leaf(const Shape& shape, Generator& gen, bool transposed = false, double lo = -1, double hi = 1) {
  Tensor t;
  if (transposed && shape.size() >= 2) {
    Shape s = shape;
    std::swap(s[s.size() - 1], s[s.size() - 2]);
    t = prim::transpose(rand(s, DType::f64, kCPU, &gen, lo, hi), -1, -2);
  } else {
    t = rand(shape, DType::f64, kCPU, &gen, lo, hi);
  }
  t.set_requires_grad(true);
  return t;
}

}  // namespace mpt::testing
