#include "tools/mpt-scaler/plot.h"

#include <algorithm>
#include <cmath>

#include "tensor/error.h"
#include "tools/mpt-scaler/png.h"

namespace mpt::tools {
namespace {

const Rgb kPalette[] = {{31, 119, 180}, {255, 127, 14}, {44, 160, 44},  {214, 39, 40},
                        {148, 103, 189}, {140, 86, 75}, {227, 119, 194}, {127, 127, 127}};
const Rgb kInk{0, 0, 0}, kGrid{225, 225, 225};

}  // namespace

ScaleSeries series_from_trace(const std::string& label, const std::vector<amp::ScalerTraceRow>& rows) {
  ScaleSeries s;
  s.label = label;
  for (const auto& r : rows) {
    s.steps.push_back(static_cast<double>(r.step));
    s.scales.push_back(r.scale);
  }
  // The last update's result, where the step after the trace would start:
  // without it the last step (and a one-row trace) would draw nothing.
  if (!rows.empty()) {
    s.steps.push_back(static_cast<double>(rows.back().step + 1));
    s.scales.push_back(rows.back().next_scale);
  }
  return s;
}

std::string series_colour(size_t i) {
  const Rgb c = kPalette[i % std::size(kPalette)];
  return fmt::format("#{:02x}{:02x}{:02x}", c.r, c.g, c.b);
}

void plot_scale_trajectories(const std::string& path, const std::vector<ScaleSeries>& series, int width, int height) {
  check(!series.empty(), "plot_scale_trajectories: nothing to plot");
  double x_max = 1, y_lo = INFINITY, y_hi = -INFINITY;
  for (const auto& s : series) {
    check(s.steps.size() == s.scales.size(), "plot_scale_trajectories: series '{}' has {} steps but {} scales",
          s.label, s.steps.size(), s.scales.size());
    for (size_t i = 0; i < s.steps.size(); ++i) {
      check(s.scales[i] > 0, "plot_scale_trajectories: series '{}' has scale {} at step {}; log2 needs it positive",
            s.label, s.scales[i], s.steps[i]);
      x_max = std::max(x_max, s.steps[i]);
      y_lo = std::min(y_lo, std::floor(std::log2(s.scales[i])));
      y_hi = std::max(y_hi, std::ceil(std::log2(s.scales[i])));
    }
  }
  check(std::isfinite(y_lo), "plot_scale_trajectories: every series is empty");
  y_lo -= 1;
  y_hi += 1;

  Canvas canvas(width, height);
  const int left = 80, right = 20, top = 20, bottom = 50;
  const int plot_w = width - left - right, plot_h = height - top - bottom;
  check(plot_w > 10 && plot_h > 10, "plot_scale_trajectories: {}x{} is too small", width, height);
  auto px = [&](double x) { return left + static_cast<int>(std::lround(x / x_max * plot_w)); };
  auto py = [&](double log2_scale) {
    return top + plot_h - static_cast<int>(std::lround((log2_scale - y_lo) / (y_hi - y_lo) * plot_h));
  };

  // Grid and labels: a line per power of two (thinned to at most ~12).
  const int y_step = std::max(1, static_cast<int>(std::ceil((y_hi - y_lo) / 12)));
  for (int k = static_cast<int>(y_lo); k <= static_cast<int>(y_hi); ++k) {
    if (k % y_step) continue;
    canvas.line(left, py(k), left + plot_w, py(k), kGrid);
    canvas.text(8, py(k) - 5, fmt::format("2^{}", k), kInk);
  }
  // Five steps between ticks at most; fewer for a short trace, whose ticks
  // then fall on whole steps.
  const int ticks = static_cast<int>(std::min(5.0, x_max));
  for (int i = 0; i <= ticks; ++i) {
    const double x = x_max * i / ticks;
    canvas.line(px(x), top, px(x), top + plot_h, kGrid);
    const std::string label = fmt::format("{}", std::llround(x));
    canvas.text(px(x) - static_cast<int>(label.size()) * 4, top + plot_h + 12, label, kInk);
  }
  canvas.line(left, top, left, top + plot_h, kInk, 2);
  canvas.line(left, top + plot_h, left + plot_w, top + plot_h, kInk, 2);

  for (size_t s = 0; s < series.size(); ++s) {
    const Rgb c = kPalette[s % std::size(kPalette)];
    const auto& xs = series[s].steps;
    const auto& ys = series[s].scales;
    for (size_t i = 0; i + 1 < xs.size(); ++i) {
      const int x0 = px(xs[i]), x1 = px(xs[i + 1]);
      const int y0 = py(std::log2(ys[i])), y1 = py(std::log2(ys[i + 1]));
      canvas.line(x0, y0, x1, y0, c, 2);  // held until the next update ...
      if (y1 != y0) canvas.line(x1, y0, x1, y1, c, 2);  // ... then it jumps
    }
    // Legend: a swatch per series, numbered in order.
    const int lx = left + plot_w - 60, ly = top + 8 + static_cast<int>(s) * 16;
    for (int d = 0; d < 10; ++d) canvas.line(lx, ly + d, lx + 14, ly + d, c);
    canvas.text(lx + 20, ly, fmt::format("{}", s + 1), kInk);
  }
  write_png(path, canvas);
}

}  // namespace mpt::tools
