#pragma once
// Loss-scale trajectories as a PNG: steps on x, log2(scale) on y, one
// colour per series, drawn as steps (the scale is constant between updates).
#include <string>
#include <vector>

#include "amp/scaler_trace.h"

namespace mpt::tools {

struct ScaleSeries {
  std::string label;
  std::vector<double> steps;
  std::vector<double> scales;  // positive
};

// Each row's step and scale, then one point more: the last row's next_scale
// at the step after it.
ScaleSeries series_from_trace(const std::string& label, const std::vector<amp::ScalerTraceRow>& rows);

// Colour i of the palette the plot uses, as "#rrggbb" (for a legend printed beside it).
std::string series_colour(size_t i);

void plot_scale_trajectories(const std::string& path, const std::vector<ScaleSeries>& series, int width = 1000,
                             int height = 500);

}  // namespace mpt::tools
