#include "amp/scaler_plot.h"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include <fmt/ranges.h>

#include "tensor/error.h"

extern char** environ;

namespace mpt::amp {
namespace {

// matplotlib's first colours: told apart by most readers, colour-blind ones too.
const char* const kPalette[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728",
                                "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"};

// A gnuplot string in double quotes: "\n" starts a new line of a title.
std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') out += "\\n";
    else out += c;
  }
  return out + "\"";
}

void append_block(std::string& script, const std::string& name, const std::vector<double>& xs,
                  const std::vector<double>& ys) {
  script += fmt::format("${} << EOD\n", name);
  for (size_t i = 0; i < xs.size(); ++i) script += fmt::format("{} {}\n", xs[i], ys[i]);
  script += "EOD\n";
}

}  // namespace

ScaleSeries series_from_trace(const std::string& label, const std::vector<ScalerTraceRow>& rows) {
  ScaleSeries s;
  s.label = label;
  for (size_t i = 0; i < rows.size(); ++i) {
    // Only the steps where the scale changes: a staircase drawn from them is
    // the same, and a long replay's script stays small.
    if (i == 0 || rows[i].scale != rows[i - 1].scale) {
      s.steps.push_back(static_cast<double>(rows[i].step));
      s.scales.push_back(rows[i].scale);
    }
    if (rows[i].skipped) {
      s.skipped_steps.push_back(static_cast<double>(rows[i].step));
      s.skipped_scales.push_back(rows[i].scale);
    }
  }
  // The last update's result, where the step after the trace would start:
  // without it the last step (and a one-row trace) would draw nothing.
  if (!rows.empty()) {
    s.steps.push_back(static_cast<double>(rows.back().step + 1));
    s.scales.push_back(rows.back().next_scale);
  }
  return s;
}

std::string gnuplot_script(const ScalePlot& plot, const std::string& png_path) {
  check(!plot.series.empty(), "plot: nothing to plot");
  double x_max = 1, y_lo = INFINITY, y_hi = -INFINITY;
  for (const auto& s : plot.series) {
    check(!s.steps.empty(), "plot: '{}' has no steps", s.label);
    check(s.steps.size() == s.scales.size() && s.skipped_steps.size() == s.skipped_scales.size(),
          "plot: '{}' has as many steps as scales", s.label);
    for (size_t i = 0; i < s.steps.size(); ++i) {
      check(s.scales[i] > 0 && std::isfinite(s.scales[i]),
            "plot: '{}' has scale {} at step {}; a log2 axis needs it positive and finite", s.label, s.scales[i],
            s.steps[i]);
      x_max = std::max(x_max, s.steps[i]);
      y_lo = std::min(y_lo, std::floor(std::log2(s.scales[i])));
      y_hi = std::max(y_hi, std::ceil(std::log2(s.scales[i])));
    }
  }
  // A power of two of room above and below, so a flat line is not drawn on
  // the frame; at most about 12 labelled powers of two.
  y_lo -= 1;
  y_hi += 1;
  const int y_step = std::max(1, static_cast<int>(std::ceil((y_hi - y_lo) / 12)));

  std::string script = fmt::format(
      "# Loss-scale trajectories, written by mpt-scaler. Its data files hold every\n"
      "# step; the blocks below hold what is drawn (each change of scale, each\n"
      "# skipped step). `gnuplot {0}` redraws {1} (run it where mpt-scaler ran);\n"
      "# `gnuplot -e \"output='other.png'\" {0}` draws into other.png.\n",
      std::filesystem::path(gnuplot_script_path(png_path)).filename().string(), png_path);
  script += fmt::format("if (!exists(\"output\")) output = {}\n", quoted(png_path));
  script += fmt::format("set terminal pngcairo size {},{} enhanced font \"Sans,10\"\n", plot.width, plot.height);
  script += "set output output\n";
  // Names are printed as they are: "growth_interval" keeps its underscore
  // rather than becoming a subscript. Only the axis' powers of two use
  // gnuplot's enhanced text (2^{16}).
  script += fmt::format("set title {} noenhanced\n", quoted(plot.title));
  script += "set xlabel \"step\" noenhanced\n";
  script += fmt::format("set ylabel \"{} (log2)\" noenhanced\n", plot.y_label);
  script += fmt::format("set xrange [0:{}]\n", x_max);
  script += "set logscale y 2\n";
  script += fmt::format("set yrange [2**{}:2**{}]\n", y_lo, y_hi);
  script += fmt::format("set ytics 2**{}\n", y_step);
  script += "set format y \"2^{%L}\"\n";
  script += "set mytics 1\n";
  script += "set grid xtics ytics lt 1 lw 1 lc rgb \"#d0d0d0\"\n";
  script += "set key outside right top box Left reverse\n";  // beside the plot: no line hidden under it

  bool any_skipped = false;
  std::vector<std::string> elements;
  for (size_t i = 0; i < plot.series.size(); ++i) {
    const ScaleSeries& s = plot.series[i];
    const char* colour = kPalette[i % std::size(kPalette)];
    append_block(script, fmt::format("scale{}", i + 1), s.steps, s.scales);
    elements.push_back(fmt::format("$scale{} using 1:2 with steps lw 2 lc rgb \"{}\" title {} noenhanced", i + 1,
                                   colour, quoted(s.label)));
    if (s.skipped_steps.empty()) continue;
    any_skipped = true;
    append_block(script, fmt::format("skipped{}", i + 1), s.skipped_steps, s.skipped_scales);
    elements.push_back(
        fmt::format("$skipped{} using 1:2 with points pt 7 ps 0.6 lc rgb \"{}\" notitle", i + 1, colour));
  }
  // One legend entry for the markers of every series (each in its colour).
  if (any_skipped)
    elements.push_back("NaN with points pt 7 ps 0.6 lc rgb \"black\" title \"skipped step (overflow)\" noenhanced");
  script += "plot ";
  for (size_t i = 0; i < elements.size(); ++i) script += (i ? ", \\\n     " : "") + elements[i];
  script += "\n";
  return script;
}

std::string gnuplot_script_path(const std::string& png_path) {
  return std::filesystem::path(png_path).replace_extension(".gp").string();
}

std::optional<std::string> find_gnuplot() {
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/bin:/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    const size_t end = std::min(dirs.find(':', start), dirs.size());
    const std::string dir = dirs.substr(start, end - start);
    const std::filesystem::path candidate = std::filesystem::path(dir.empty() ? "." : dir) / "gnuplot";
    std::error_code ec;
    if (std::filesystem::is_regular_file(candidate, ec) && ::access(candidate.c_str(), X_OK) == 0)
      return candidate.string();
    start = end + 1;
  }
  return std::nullopt;
}

std::string gnuplot_missing_message(const std::vector<std::string>& data_paths, const std::string& script_path,
                                    const std::string& png_path) {
  const std::string data = data_paths.empty() ? fmt::format("only in {} (no --out)", script_path)
                                               : fmt::format("in {}", fmt::join(data_paths, ", "));
  return fmt::format(
      "plotting needs gnuplot (apt install gnuplot-nox), which is not on PATH: {} was not drawn. The data is {}; "
      "`gnuplot {}` draws {} once gnuplot is installed",
      png_path, data, script_path, png_path);
}

void run_gnuplot(const std::string& gnuplot, const std::string& script_path, const std::string& output) {
  // gnuplot's single-quoted strings escape a quote by doubling it.
  std::string output_value = "output='";
  for (char c : output) output_value += c == '\'' ? std::string("''") : std::string(1, c);
  output_value += "'";
  std::vector<std::string> args = {"gnuplot", "-e", output_value, script_path};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  // No shell between: paths reach gnuplot as they are.
  const int error = ::posix_spawn(&pid, gnuplot.c_str(), nullptr, nullptr, argv.data(), environ);
  check<IOError>(error == 0, "cannot run gnuplot ({}): {}", gnuplot, std::strerror(error));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    check<IOError>(errno == EINTR, "waiting for gnuplot failed: {}", std::strerror(errno));
  }
  check<IOError>(WIFEXITED(status) && WEXITSTATUS(status) == 0,
                 "gnuplot failed ({}) on {}; its messages are above", WIFEXITED(status)
                     ? fmt::format("exit status {}", WEXITSTATUS(status))
                     : fmt::format("signal {}", WIFSIGNALED(status) ? WTERMSIG(status) : 0),
                 script_path);
  check<IOError>(std::filesystem::exists(output), "gnuplot drew nothing into '{}' (script {})", output, script_path);
}

}  // namespace mpt::amp
