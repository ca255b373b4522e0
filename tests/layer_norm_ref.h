#pragma once
// Layer norm by its definition in f64, for tests to hold the library's
// kernels against.
#include <cmath>
#include <cstdint>
#include <vector>

namespace mpt::testing {

// Layer norm over rows of d, by its definition in f64: per row the mean, the
// biased variance, xhat = (x - mean) / sqrt(var + eps), y = xhat * w + b (w
// and b empty: 1 and 0). Given an output gradient dy, also the gradients of
// x, w and b by the analytic formula dx = rstd * (g - mean(g) - xhat *
// mean(g * xhat)) with g = dy * w, dw = sum of dy * xhat, db = sum of dy.
struct LayerNormRef {
  std::vector<double> y, xhat, gx, gw, gb;
};

inline LayerNormRef layer_norm_ref(const std::vector<double>& x, const std::vector<double>& w,
                                   const std::vector<double>& b, int64_t d, double eps,
                                   const std::vector<double>& dy = {}) {
  const int64_t n = static_cast<int64_t>(x.size()), rows = n / d;
  LayerNormRef r;
  r.y.resize(n);
  r.xhat.resize(n);
  r.gx.assign(n, 0.0);
  r.gw.assign(d, 0.0);
  r.gb.assign(d, 0.0);
  auto weight = [&](int64_t j) { return w.empty() ? 1.0 : w[j]; };
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t at = row * d;
    double mean = 0, var = 0;
    for (int64_t j = 0; j < d; ++j) mean += x[at + j];
    mean /= static_cast<double>(d);
    for (int64_t j = 0; j < d; ++j) var += (x[at + j] - mean) * (x[at + j] - mean);
    var /= static_cast<double>(d);
    const double rstd = 1 / std::sqrt(var + eps);
    for (int64_t j = 0; j < d; ++j) {
      r.xhat[at + j] = (x[at + j] - mean) * rstd;
      r.y[at + j] = r.xhat[at + j] * weight(j) + (b.empty() ? 0.0 : b[j]);
    }
    if (dy.empty()) continue;
    double mean_g = 0, mean_g_xhat = 0;
    for (int64_t j = 0; j < d; ++j) {
      mean_g += dy[at + j] * weight(j);
      mean_g_xhat += dy[at + j] * weight(j) * r.xhat[at + j];
    }
    mean_g /= static_cast<double>(d);
    mean_g_xhat /= static_cast<double>(d);
    for (int64_t j = 0; j < d; ++j) {
      r.gx[at + j] = rstd * (dy[at + j] * weight(j) - mean_g - r.xhat[at + j] * mean_g_xhat);
      r.gw[j] += dy[at + j] * r.xhat[at + j];
      r.gb[j] += dy[at + j];
    }
  }
  return r;
}

}  // namespace mpt::testing
