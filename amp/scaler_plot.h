#pragma once
// Loss-scale trajectories drawn by gnuplot (its pngcairo terminal): steps on
// x, the scale on a log2 axis, one named line per series, its skipped
// (overflow) steps marked with points.
//
// A caller (mpt-scaler) writes its data files first; they stay the source
// of truth. The plot is a gnuplot script written beside the PNG (the same
// name, .gp), holding the points it draws, which gnuplot then runs. Without
// gnuplot the script is still written, and `gnuplot NAME.gp` draws the PNG
// later.
#include <optional>
#include <string>
#include <vector>

#include "amp/scaler_trace.h"

namespace mpt::amp {

struct ScaleSeries {
  std::string label;  // its legend entry
  // The staircase: each step at which the scale changes (the first one too),
  // then the step after the last row with that row's next_scale.
  std::vector<double> steps, scales;
  // The skipped steps and the scale each was skipped at.
  std::vector<double> skipped_steps, skipped_scales;
};

ScaleSeries series_from_trace(const std::string& label, const std::vector<ScalerTraceRow>& rows);

struct ScalePlot {
  std::string title;  // lines separated by '\n'
  std::vector<ScaleSeries> series;
  int width = 1000, height = 500;  // pixels
  std::string y_label = "loss scale";  // "(log2)" is added
};

// The gnuplot script that draws `plot` into the PNG named by the gnuplot
// variable `output`, png_path where it is not set (`gnuplot -e
// "output='x.png'" script` draws into x.png). ValueError for a plot with no
// points or a scale that is not positive.
std::string gnuplot_script(const ScalePlot& plot, const std::string& png_path);

// The script's path for a PNG: "run.png" -> "run.gp".
std::string gnuplot_script_path(const std::string& png_path);

// gnuplot's path where PATH has it, otherwise nothing.
std::optional<std::string> find_gnuplot();

// What a tool says where gnuplot is missing.
std::string gnuplot_missing_message(const std::vector<std::string>& data_paths, const std::string& script_path,
                                    const std::string& png_path);

// Runs gnuplot (its path) on a script written by gnuplot_script, drawing
// into `output`. IOError where it cannot start or fails (its own messages
// go to standard error).
void run_gnuplot(const std::string& gnuplot, const std::string& script_path, const std::string& output);

}  // namespace mpt::amp
