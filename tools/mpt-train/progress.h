#pragma once
// What a run shows while it trains: a progress bar redrawn in place on a
// terminal, plain lines every few steps elsewhere (logs, CI), an
// end-of-epoch summary, and machine-readable metrics as JSON lines.
// message() and record() may be called from other threads (the GPU sampler).
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <mutex>
#include <string>

#include <nlohmann/json.hpp>

namespace mpt::tools {

// `s` as UTF-8, other bytes replaced by U+FFFD, the same way every time:
// JSON strings (metrics, checkpoint metadata) must be UTF-8, and a data path
// or a sampled text may hold other bytes (a Latin-1 name, a character cut in
// two by a byte-level model).
std::string as_utf8(const std::string& s);

class Progress {
 public:
  enum class Style { bar, lines, none };
  // style "auto": a bar when stdout is a terminal, else lines.
  Progress(const std::string& style, int64_t epochs, const std::string& metrics_path);

  // After each optimizer step: where it is (epoch counted from 0), for the
  // bar. `loss` reads the step's loss: called only when the bar is drawn
  // (it waits for the GPU).
  void tick(int64_t epoch, int64_t step_in_epoch, int64_t steps_in_epoch, const std::function<double()>& loss);
  // At a logging step: a step event in the metrics (with `fields`: the
  // step-time breakdown, the scale, ...), and a line in the lines style.
  void log(int64_t global_step, double loss, double lr, double samples_per_s, const nlohmann::ordered_json& fields);
  void end_epoch(int64_t epoch, int64_t epochs, const nlohmann::ordered_json& summary);  // also printed as one line
  void message(const std::string& text);
  // One JSON object per line in the metrics file (when there is one).
  void record(const nlohmann::ordered_json& entry);

 private:
  void finish_bar();
  void write(const nlohmann::ordered_json& entry);
  std::mutex mutex_;
  Style style_;
  int64_t epochs_;
  // The latest tick's place, and the latest logged rate (the bar's).
  int64_t epoch_ = 0, step_in_epoch_ = 0, steps_in_epoch_ = 0;
  double samples_per_s_ = 0;
  bool bar_open_ = false;
  std::chrono::steady_clock::time_point last_draw_{};
  std::ofstream metrics_;
};

}  // namespace mpt::tools
