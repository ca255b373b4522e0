// mpt-scaler: a lab for loss-scaler research.
//   replay  overflow patterns through the policies, writing trajectories
//   sweep   a real training run across growth intervals
//   plot    scale trajectories (traces) drawn by gnuplot as a PNG
//
//   mpt-scaler replay --policy all --pattern bursts:700:3 --steps 20000 --growth-interval 200
//                     --out run.jsonl --plot run.png       (one command line)
//   mpt-scaler sweep --intervals 50,200,1000 --steps 2000 --device cuda --out sweep.json --plot sweep.png
//   mpt-scaler plot run.torch.jsonl trace-from-training.csv --out both.png
//
// The data files are written first and stay the source of truth; --plot
// adds a gnuplot script beside the PNG (run.png: run.gp) and runs gnuplot on
// it. Without gnuplot the data and the script are written, the PNG is not,
// and the command ends with status 1 after saying so.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>

#include <fmt/ranges.h>

#include "amp/scaler_replay.h"
#include "amp/scaler_sweep.h"
#include "tensor/error.h"
#include "tools/atomic_output.h"
#include "tools/cli_checks.h"
#include "tools/scaler_flags.h"
#include "amp/scaler_plot.h"
#include "tools/mpt-scaler/progress.h"
#include "tools/mpt-scaler/fp8_lab.h"
#include "tools/mpt-scaler/sweep_training.h"

using namespace mpt;

namespace {

constexpr int64_t kMaxReplaySteps = 100'000'000;

// "run.jsonl" + "torch" -> "run.torch.jsonl" (one output per policy).
std::string path_for(const std::string& path, const std::string& tag, bool several) {
  if (!several) return path;
  const std::filesystem::path p(path);
  return (p.parent_path() / (p.stem().string() + "." + tag + p.extension().string())).string();
}

void write_rows(const std::string& path, const std::vector<amp::ScalerTraceRow>& rows) {
  amp::ScalerTraceWriter writer(path);
  tools::ProgressBar bar("writing " + path, static_cast<int64_t>(rows.size()));
  for (size_t i = 0; i < rows.size(); ++i) {
    writer.write(rows[i]);
    if (i % 1024 == 0 || i + 1 == rows.size()) bar.update(static_cast<int64_t>(i + 1));
  }
  bar.finish();
}

// Refuses an output path that cannot be written before any work, rather
// than after it (appending nothing leaves an existing file as it is; a file
// the try made is removed, so a failed command leaves no empty one).
void check_writable(const std::string& flag, const std::string& path) {
  if (path.empty()) return;
  const bool existed = std::filesystem::exists(path);
  check<IOError>(std::ofstream(path, std::ios::app).good(), "cannot write {} '{}'", flag, path);
  if (!existed) std::filesystem::remove(path);
}

using Outputs = std::vector<std::unique_ptr<tools::AtomicOutput>>;

// A new output of the command, committed with the others at its end.
tools::AtomicOutput& add_output(Outputs& outputs, const std::string& path) {
  outputs.push_back(std::make_unique<tools::AtomicOutput>(path));
  return *outputs.back();
}

void write_text(const std::string& path, const std::string& text, const std::string& what) {
  std::ofstream out(path);
  check<IOError>(out.good(), "cannot write {} '{}'", what, path);
  out << text << std::flush;
  check<IOError>(out.good(), "writing {} '{}' failed", what, path);
}

// --plot PNG: writes its gnuplot script and, with gnuplot (its path), draws
// the PNG, both as outputs of the command. Without gnuplot only the script
// is written; the caller says so once the data is committed.
void draw_plot(const amp::ScalePlot& plot, const std::string& png, const std::optional<std::string>& gnuplot,
               Outputs& outputs) {
  const std::string script = amp::gnuplot_script_path(png);
  const std::string& script_temp = add_output(outputs, script).temp_path();
  write_text(script_temp, amp::gnuplot_script(plot, png), "the plot's script");
  if (gnuplot) amp::run_gnuplot(*gnuplot, script_temp, add_output(outputs, png).temp_path());
}

// A plot's PNG is named .png: its script takes the same name with .gp.
void check_png_name(const std::string& flag, const std::string& path) {
  check(path.empty() || std::filesystem::path(path).extension() == ".png", "mpt-scaler: {} must name a .png file, got '{}'",
        flag, path);
}

// The scaler's settings for a plot's title.
std::string settings_text(const tools::ScalerFlags& f, bool hysteresis) {
  const amp::GradScalerOptions& o = f.options;
  std::string text = fmt::format("init scale {}, growth factor {}, backoff factor {}", o.init_scale, o.growth_factor,
                                 o.backoff_factor);
  if (hysteresis)
    text += fmt::format(", hysteresis {}{}", o.hysteresis, o.consecutive_hysteresis ? " (consecutive)" : "");
  if (f.min_scale > 0) text += fmt::format(", min scale {}", f.min_scale);
  if (f.max_scale > 0) text += fmt::format(", max scale {}", f.max_scale);
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"mpt-scaler: replay overflow patterns through loss-scaler policies, sweep growth intervals on a "
               "real training run, plot scale trajectories"};
  app.require_subcommand(1);

  // ---- replay ----
  auto* replay = app.add_subcommand("replay", "replay an overflow pattern through one or more policies");
  tools::ScalerFlags replay_flags;
  replay_flags.add_to(*replay, {.growth_interval = true, .hysteresis = true, .bounds = true});
  std::vector<std::string> policies{"torch"};
  std::string pattern = "bernoulli:0.001", replay_out = "scale.jsonl", replay_plot;
  int64_t replay_steps = 10000;
  uint64_t seed = 0;
  replay->add_option("--policy", policies, "torch, hysteresis, static or all (repeatable)")
      ->check(CLI::IsMember({"torch", "hysteresis", "static", "all"}))
      ->capture_default_str();
  replay->add_option("--pattern", pattern,
                     "bernoulli:P | bursts:EVERY:LENGTH | periodic:PERIOD | file:PATH (see below)")
      ->capture_default_str();
  replay->footer(
      "Overflow patterns (--pattern; steps count from 0):\n"
      "  bernoulli:P          each step overflows with probability P (the same steps for the same --seed)\n"
      "  bursts:EVERY:LENGTH  LENGTH overflows in a row, starting at steps EVERY-1, 2*EVERY-1, ...\n"
      "  periodic:PERIOD      one overflow at steps PERIOD-1, 2*PERIOD-1, ...\n"
      "  file:PATH            one step per line: 1 or true overflows, 0 or false does not; '#' starts a\n"
      "                       comment, blank lines are skipped. A scaler trace (.jsonl, .json or .csv, as\n"
      "                       replay --out or GradScaler's trace writer writes it) gives its found_inf\n"
      "                       column. The file sets the number of steps (--steps is ignored).\n"
      "--plot run.png also writes run.gp, the gnuplot script that draws it; without gnuplot (apt install\n"
      "gnuplot-nox) the trajectories and the script are written, the PNG is not, and the status is 1.");
  // At most 10^8: a replay keeps every step's row (tens of bytes) in memory.
  replay->add_option("--steps", replay_steps, "steps to generate, at most 100000000 (ignored for file:)")
      ->check(tools::positive())
      ->check(CLI::Range(int64_t{1}, kMaxReplaySteps))
      ->capture_default_str();
  replay->add_option("--seed", seed)->capture_default_str();
  replay->add_option("--out", replay_out, "trajectory file (.jsonl or .csv); several policies add .<policy>")
      ->capture_default_str();
  replay->add_option("--plot", replay_plot, "also draw the trajectories into this PNG (with gnuplot; see below)");

  // ---- sweep ----
  auto* sweep = app.add_subcommand("sweep", "train the same model once per growth interval and compare");
  tools::ScalerFlags sweep_flags;
  sweep_flags.add_to(*sweep, {.growth_interval = false, .hysteresis = true, .bounds = true});
  std::vector<int64_t> intervals{50, 200, 1000};
  tools::SweepTrainingConfig training;
  std::string device = "cpu", dtype = "f16", policy = "torch", unit = "steps", sweep_out = "sweep.json", sweep_plot;
  sweep->add_option("--intervals", intervals, "growth intervals to try, one run each (comma-separated)")
      ->delimiter(',')
      ->check(tools::positive())
      ->capture_default_str();
  sweep->add_option("--model", training.model, "mlp or cnn (Fashion-MNIST), gpt (fortunes text)")
      ->check(CLI::IsMember({"mlp", "cnn", "gpt"}))
      ->capture_default_str();
  sweep->add_option("--data", training.data,
                    "for mlp and cnn fashion-mnist (their default: Debian's copy) or a folder holding Fashion-MNIST's "
                    "four .gz files; for gpt a text file, or 'fortunes' (its default), as mpt-train --data");
  sweep->add_option("--steps", training.steps, "training steps of each run")
      ->check(tools::positive())
      ->capture_default_str();
  sweep->add_option("--batch", training.batch)->check(tools::positive())->capture_default_str();
  sweep->add_option("--lr", training.lr)->check(tools::non_negative())->capture_default_str();
  sweep->add_option("--seed", training.seed)->capture_default_str();
  sweep->add_option("--device", device, "cpu or cuda[:N]")->capture_default_str();
  sweep->add_option("--dtype", dtype, "autocast dtype: f16 or bf16")
      ->check(CLI::IsMember({"f16", "bf16"}))
      ->capture_default_str();
  sweep->add_option("--policy", policy, "torch, hysteresis or static")
      ->check(CLI::IsMember({"torch", "hysteresis", "static"}))
      ->capture_default_str();
  sweep->add_option("--growth-unit", unit, "steps, micro_batches or samples")
      ->check(CLI::IsMember({"steps", "micro_batches", "samples"}))
      ->capture_default_str();
  sweep->add_option("--out", sweep_out, "results as JSON: the configuration, each run's statistics and trajectory")
      ->capture_default_str();
  sweep->add_option("--plot", sweep_plot, "scale trajectories of every run as a PNG (with gnuplot; see below)");
  sweep->footer(
      "--plot sweep.png also writes sweep.gp, the gnuplot script that draws it; without gnuplot (apt install\n"
      "gnuplot-nox) the JSON and the script are written, the PNG is not, and the status is 1.");

  // ---- fp8 ----
  auto* fp8 = app.add_subcommand(
      "fp8", "train with FP8 linear layers once per amax history length and margin, tracing each FP8 tensor");
  tools::SweepTrainingConfig fp8_training;
  std::vector<int64_t> fp8_histories{1, 16, 1024};
  std::vector<double> fp8_margins{0};
  std::string fp8_device = "cpu", fp8_recipe = "delayed", fp8_reduction = "max", fp8_out = "fp8.json", fp8_plot,
              fp8_plot_tensor;
  fp8->add_option("--model", fp8_training.model, "mlp or cnn (Fashion-MNIST), gpt (fortunes text)")
      ->check(CLI::IsMember({"mlp", "cnn", "gpt"}))
      ->capture_default_str();
  fp8->add_option("--data", fp8_training.data, "as sweep's --data");
  fp8->add_option("--steps", fp8_training.steps, "training steps of each run")
      ->check(tools::positive())
      ->capture_default_str();
  fp8->add_option("--batch", fp8_training.batch, "a multiple of 16 (FP8 products need one)")
      ->check(tools::positive())
      ->capture_default_str();
  fp8->add_option("--lr", fp8_training.lr)->check(tools::non_negative())->capture_default_str();
  fp8->add_option("--seed", fp8_training.seed)->capture_default_str();
  fp8->add_option("--device", fp8_device, "cpu or cuda[:N] (FP8 products need compute capability 8.9)")
      ->capture_default_str();
  fp8->add_option("--recipe", fp8_recipe, "delayed (amax history) or current (each tensor's own amax)")
      ->check(CLI::IsMember({"delayed", "current"}))
      ->capture_default_str();
  fp8->add_option("--reduction", fp8_reduction, "delayed: the history's max or its most_recent entry")
      ->check(CLI::IsMember({"max", "most_recent"}))
      ->capture_default_str();
  fp8->add_option("--histories", fp8_histories, "amax history lengths to try (comma-separated; delayed only)")
      ->delimiter(',')
      ->check(tools::positive())
      ->capture_default_str();
  fp8->add_option("--margins", fp8_margins, "margins to try, in powers of two below the format's maximum")
      ->delimiter(',')
      ->capture_default_str();
  fp8->add_option("--out", fp8_out, "results as JSON: the configuration, and per run and FP8 tensor its traces")
      ->capture_default_str();
  fp8->add_option("--plot", fp8_plot, "one tensor's scale in every run as a PNG (with gnuplot)");
  fp8->add_option("--plot-tensor", fp8_plot_tensor,
                  "the tensor --plot draws (default: the first layer's output gradient, e.g. layers.0.grad_output)");

  // ---- plot ----
  auto* plot = app.add_subcommand("plot", "draw scale trajectories from traces (.jsonl/.csv) as a PNG");
  std::vector<std::string> traces;
  std::string plot_out = "scale.png";
  int width = 1000, height = 500;
  std::string plot_title;
  plot->add_option("traces", traces, "trace files")->required();
  plot->add_option("--out", plot_out, "the PNG; its gnuplot script is written beside it (.gp)")->capture_default_str();
  plot->add_option("--title", plot_title, "the plot's title (default: the trace files' names)");
  plot->add_option("--width", width, "pixels")->check(CLI::Range(200, 16384))->capture_default_str();
  plot->add_option("--height", height, "pixels")->check(CLI::Range(200, 16384))->capture_default_str();

  if (const auto status = tools::parse_command_line(app, argc, argv)) return *status;

  // Values no run could take end the tool as a usage error, before any work.
  std::vector<bool> overflows;
  amp::GradScalerOptions sweep_options;
  try {
    if (*replay) {
      if (std::find(policies.begin(), policies.end(), "all") != policies.end()) {
        check(policies.size() == 1, "mpt-scaler replay: --policy all stands alone, got {} policies", policies.size());
        policies = {"torch", "hysteresis", "static"};
      }
      for (const std::string& name : policies) replay_flags.checked(amp::scale_policy_from_name(name), "mpt-scaler replay");
      (void)amp::trace_format_for_path(replay_out);  // .jsonl or .csv
      check_png_name("--plot", replay_plot);
      overflows = amp::overflow_pattern_from_spec(pattern, replay_steps, seed);
    } else if (*sweep) {
      sweep_options = sweep_flags.checked(amp::scale_policy_from_name(policy), "mpt-scaler sweep");
      sweep_options.growth_unit = amp::growth_unit_from_name(unit);
      training.device = Device(device);
      training.autocast_dtype = dtype_from_name(dtype);
      tools::check_sweep_data(training);
      check_png_name("--plot", sweep_plot);
    } else if (*plot) {
      check_png_name("--out", plot_out);
    } else if (*fp8) {
      fp8_training.device = Device(fp8_device);
      check(fp8_training.batch % 16 == 0, "mpt-scaler fp8: --batch {} is not a multiple of 16 (FP8 products need one)",
            fp8_training.batch);
      if (fp8_recipe == "current") fp8_histories = {1};  // no history to vary
      for (double m : fp8_margins) check(std::isfinite(m), "mpt-scaler fp8: --margins must be finite, got {}", m);
      tools::check_sweep_data(fp8_training);
      check_png_name("--plot", fp8_plot);
    }
  } catch (const Error& e) {  // a value, device name or pattern file that is wrong
    std::fprintf(stderr, "%s%s\n", std::string_view(e.what()).starts_with("mpt-scaler") ? "" : "mpt-scaler: ", e.what());
    return tools::kUsageError;
  }

  // Where --plot is given, gnuplot draws the PNG; without it the rest is
  // still written, and the command ends with status 1 after saying so.
  const bool plotting =
      (*replay && !replay_plot.empty()) || (*sweep && !sweep_plot.empty()) || (*fp8 && !fp8_plot.empty()) || *plot;
  const std::optional<std::string> gnuplot = plotting ? amp::find_gnuplot() : std::nullopt;
  std::string png;                      // the plot asked for, if any
  std::vector<std::string> data_paths;  // what a missing gnuplot's message points to
  try {
    // Every output is committed at the end: a failure leaves the files of
    // an earlier run as they were, not a mix of old and new ones.
    Outputs outputs;
    if (*replay) {
      for (const std::string& name : policies) check_writable("--out", path_for(replay_out, name, policies.size() > 1));
      check_writable("--plot", replay_plot);
      if (!replay_plot.empty()) check_writable("--plot", amp::gnuplot_script_path(replay_plot));
      amp::ScalePlot scale_plot;
      for (const std::string& name : policies) {
        const auto rows = amp::replay_overflows(replay_flags.checked(amp::scale_policy_from_name(name), "mpt-scaler replay"), overflows);
        const std::string path = path_for(replay_out, name, policies.size() > 1);
        write_rows(add_output(outputs, path).temp_path(), rows);
        data_paths.push_back(path);
        int64_t skipped = 0;
        for (const auto& r : rows) skipped += r.skipped;
        std::printf("%-10s %s: %zu steps, %lld skipped, final scale %g\n", name.c_str(), path.c_str(), rows.size(),
                    static_cast<long long>(skipped), rows.empty() ? 0.0 : rows.back().next_scale);
        scale_plot.series.push_back(amp::series_from_trace(name, rows));
      }
      if (!replay_plot.empty()) {
        png = replay_plot;
        const bool hysteresis = std::find(policies.begin(), policies.end(), "hysteresis") != policies.end();
        scale_plot.title = fmt::format(
            "mpt-scaler replay: pattern {}, {} steps{}\n{} {}; {}, growth interval {}", pattern, overflows.size(),
            pattern.starts_with("bernoulli:") ? fmt::format(", seed {}", seed) : "",
            policies.size() > 1 ? "policies" : "policy", fmt::join(policies, ", "), settings_text(replay_flags, hysteresis), replay_flags.options.growth_interval);
        draw_plot(scale_plot, replay_plot, gnuplot, outputs);
      }
    } else if (*sweep) {
      // The outputs are tried before the runs, so that a path that cannot be
      // written fails now rather than after all the training.
      check_writable("--out", sweep_out);
      check_writable("--plot", sweep_plot);
      if (!sweep_plot.empty()) check_writable("--plot", amp::gnuplot_script_path(sweep_plot));
      if (!sweep_plot.empty() && !gnuplot)
        std::fprintf(stderr, "mpt-scaler: gnuplot is not on PATH (apt install gnuplot-nox): the sweep writes its data "
                             "and plot script, not the PNG\n");
      // Progress counts training steps over all runs.
      tools::ProgressBar bar("sweep", static_cast<int64_t>(intervals.size()) * training.steps);
      size_t runs_done = 0;
      std::string workload;
      const auto runs = amp::sweep_growth_interval(
          sweep_options, intervals,
          [&](const amp::GradScalerOptions& scaler, const amp::ScalerTraceSink& trace) {
            const auto result = tools::train_for_sweep(training, scaler, trace, [&](int64_t step) {
              bar.update(static_cast<int64_t>(runs_done) * training.steps + step);
            });
            workload = result.workload;
            return result.final_loss;
          },
          [&](size_t done, size_t) { runs_done = done; });
      bar.finish();
      nlohmann::ordered_json results = nlohmann::ordered_json::array();
      amp::ScalePlot scale_plot;
      std::printf("%16s %8s %8s %12s %14s\n", "growth_interval", "steps", "skipped", "final_loss", "most_time_at");
      for (const auto& run : runs) {
        auto most = std::max_element(run.steps_at_scale.begin(), run.steps_at_scale.end(),
                                     [](const auto& a, const auto& b) { return a.second < b.second; });
        std::printf("%16lld %8lld %8lld %12.5f %14g\n", static_cast<long long>(run.growth_interval),
                    static_cast<long long>(run.steps), static_cast<long long>(run.skipped_steps), run.final_loss,
                    most == run.steps_at_scale.end() ? 0.0 : most->first);
        nlohmann::ordered_json at_scale = nlohmann::ordered_json::object();
        for (const auto& [scale, n] : run.steps_at_scale) at_scale[fmt::format("{}", scale)] = n;
        nlohmann::ordered_json trajectory = nlohmann::ordered_json::array();
        for (const auto& row : run.trace) trajectory.push_back(nlohmann::ordered_json::parse(amp::scaler_trace_row_json(row)));
        results.push_back({{"growth_interval", run.growth_interval},
                           {"steps", run.steps},
                           {"skipped_steps", run.skipped_steps},
                           {"final_loss", run.final_loss},
                           {"steps_at_scale", at_scale},
                           {"trajectory", std::move(trajectory)}});
        scale_plot.series.push_back(
            amp::series_from_trace(fmt::format("growth_interval {}", run.growth_interval), run.trace));
      }
      const std::string data = tools::sweep_data(training);
      if (!sweep_out.empty()) {
        // Every option of the command, so that the file alone says how to run it again.
        const nlohmann::ordered_json config = {
            {"model", training.model},
            {"data", data},
            {"steps", training.steps},
            {"batch", training.batch},
            {"lr", training.lr},
            {"seed", training.seed},
            {"device", device},
            {"dtype", dtype},
            {"policy", policy},
            {"growth_unit", unit},
            {"intervals", intervals},
            {"init_scale", sweep_flags.options.init_scale},
            {"growth_factor", sweep_flags.options.growth_factor},
            {"backoff_factor", sweep_flags.options.backoff_factor},
            {"hysteresis", sweep_flags.options.hysteresis},
            {"consecutive_hysteresis", sweep_flags.options.consecutive_hysteresis},
            {"min_scale", sweep_flags.min_scale > 0 ? nlohmann::ordered_json(sweep_flags.min_scale) : nullptr},
            {"max_scale", sweep_flags.max_scale > 0 ? nlohmann::ordered_json(sweep_flags.max_scale) : nullptr}};
        const nlohmann::ordered_json document = {{"config", config}, {"workload", workload}, {"runs", results}};
        write_text(add_output(outputs, sweep_out).temp_path(), document.dump(2) + "\n", "--out");
        data_paths.push_back(sweep_out);
      }
      if (!sweep_plot.empty()) {
        png = sweep_plot;
        scale_plot.title = fmt::format(
            "mpt-scaler sweep: {} on {}, {} steps, batch {}, lr {}, seed {}, {} autocast on {}\npolicy {}; {}, "
            "growth interval{} {} ({})",
            training.model, data, training.steps, training.batch, training.lr, training.seed, dtype, device, policy,
            settings_text(sweep_flags, policy == "hysteresis"), intervals.size() > 1 ? "s" : "",
            fmt::join(intervals, ", "), unit);
        draw_plot(scale_plot, sweep_plot, gnuplot, outputs);
      }
    } else if (*fp8) {
      check_writable("--out", fp8_out);
      check_writable("--plot", fp8_plot);
      if (!fp8_plot.empty()) check_writable("--plot", amp::gnuplot_script_path(fp8_plot));
      const size_t run_count = fp8_histories.size() * fp8_margins.size();
      tools::ProgressBar bar("fp8", static_cast<int64_t>(run_count) * fp8_training.steps);
      const auto runs = tools::sweep_fp8(
          fp8_training, amp::fp8_scaling_mode_from_name(fp8_recipe),
          fp8_reduction == "max" ? amp::AmaxReduction::max : amp::AmaxReduction::most_recent, fp8_histories,
          fp8_margins, [&](size_t run, int64_t step) {
            bar.update(static_cast<int64_t>(run) * fp8_training.steps + step);
          });
      bar.finish();
      std::printf("%8s %8s %12s  %s\n", "history", "margin", "final_loss", "most saturated / flushed tensor (mean fraction)");
      nlohmann::ordered_json results = nlohmann::ordered_json::array();
      for (const auto& run : runs) {
        const nlohmann::ordered_json r = tools::fp8_run_json(run);
        std::string worst_saturated, worst_flushed;
        double saturated = -1, flushed = -1;
        for (const auto& t : r["tensors"]) {
          if (t["mean_saturated"].get<double>() > saturated)
            saturated = t["mean_saturated"], worst_saturated = t["name"];
          if (t["mean_flushed"].get<double>() > flushed) flushed = t["mean_flushed"], worst_flushed = t["name"];
        }
        std::printf("%8lld %8g %12.5f  %s %.3g / %s %.3g\n", static_cast<long long>(run.history_length), run.margin,
                    run.final_loss, worst_saturated.c_str(), saturated, worst_flushed.c_str(), flushed);
        results.push_back(r);
      }
      const std::string data = tools::sweep_data(fp8_training);
      const nlohmann::ordered_json config = {
          {"model", fp8_training.model}, {"data", data},           {"steps", fp8_training.steps},
          {"batch", fp8_training.batch}, {"lr", fp8_training.lr},  {"seed", fp8_training.seed},
          {"device", fp8_device},        {"recipe", fp8_recipe},   {"reduction", fp8_reduction},
          {"histories", fp8_histories},  {"margins", fp8_margins}};
      write_text(add_output(outputs, fp8_out).temp_path(),
                 nlohmann::ordered_json{{"config", config}, {"runs", results}}.dump(2) + "\n", "--out");
      data_paths.push_back(fp8_out);
      if (!fp8_plot.empty()) {
        std::string tensor = fp8_plot_tensor;
        if (tensor.empty())
          for (const auto& t : runs.front().slots)
            if (t.name.ends_with(".grad_output")) {
              tensor = t.name;
              break;
            }
        amp::ScalePlot scale_plot;
        scale_plot.y_label = "FP8 scale";
        for (const auto& run : runs) scale_plot.series.push_back(tools::fp8_scale_series(run, tensor));
        scale_plot.title = fmt::format("mpt-scaler fp8: {} on {}, {} steps, batch {}, lr {}, seed {}, on {}\n{} scaling "
                                       "({}); the scale of {}",
                                       fp8_training.model, data, fp8_training.steps, fp8_training.batch,
                                       fp8_training.lr, fp8_training.seed, fp8_device, fp8_recipe, fp8_reduction,
                                       tensor);
        png = fp8_plot;
        draw_plot(scale_plot, fp8_plot, gnuplot, outputs);
      }
    } else if (*plot) {
      amp::ScalePlot scale_plot;
      scale_plot.width = width;
      scale_plot.height = height;
      for (const std::string& trace : traces)
        scale_plot.series.push_back(amp::series_from_trace(trace, amp::read_scaler_trace(trace)));
      scale_plot.title = plot_title.empty() ? fmt::format("mpt-scaler plot: {}", fmt::join(traces, ", ")) : plot_title;
      check_writable("--out", plot_out);
      check_writable("--out", amp::gnuplot_script_path(plot_out));
      png = plot_out;
      data_paths = traces;
      draw_plot(scale_plot, plot_out, gnuplot, outputs);
    }
    for (const auto& output : outputs) output->commit();
    if (!png.empty() && gnuplot)
      std::printf("plot %s (its gnuplot script: %s)\n", png.c_str(), amp::gnuplot_script_path(png).c_str());
  } catch (const std::exception& e) {
    // mpt::Error, or what the standard library throws (std::filesystem, std::bad_alloc).
    const std::string message = e.what();
    std::fprintf(stderr, "%s%s\n", message.starts_with("mpt-scaler:") ? "" : "mpt-scaler: ", message.c_str());
    return 1;
  }
  if (!png.empty() && !gnuplot) {
    std::fprintf(stderr, "mpt-scaler: %s\n",
                 amp::gnuplot_missing_message(data_paths, amp::gnuplot_script_path(png), png).c_str());
    return 1;
  }
  return 0;
}
