#include "tools/mpt-train/progress.h"

#include <unistd.h>

#include "tensor/error.h"

namespace mpt::tools {

std::string as_utf8(const std::string& s) {
  using nlohmann::json;
  return json::parse(json(s).dump(-1, ' ', false, json::error_handler_t::replace)).get<std::string>();
}

Progress::Progress(const std::string& style, int64_t epochs, const std::string& metrics_path) : epochs_(epochs) {
  if (style == "auto")
    style_ = ::isatty(STDOUT_FILENO) ? Style::bar : Style::lines;
  else if (style == "bar")
    style_ = Style::bar;
  else if (style == "lines")
    style_ = Style::lines;
  else if (style == "none")
    style_ = Style::none;
  else
    throw ValueError(fmt::format("mpt-train: unknown --progress '{}' (auto, bar, lines, none)", style));
  if (!metrics_path.empty()) {
    metrics_.open(metrics_path, std::ios::app);
    check<IOError>(metrics_.good(), "mpt-train: cannot open the metrics file '{}'", metrics_path);
  }
}

void Progress::tick(int64_t epoch, int64_t step_in_epoch, int64_t steps_in_epoch,
                    const std::function<double()>& read_loss) {
  std::lock_guard lock(mutex_);
  epoch_ = epoch;
  step_in_epoch_ = step_in_epoch;
  steps_in_epoch_ = steps_in_epoch;
  // Redraw the bar at most ten times a second: a terminal is slower than a small model.
  const auto now = std::chrono::steady_clock::now();
  if (style_ != Style::bar ||
      (step_in_epoch != steps_in_epoch && now - last_draw_ < std::chrono::milliseconds(100)))
    return;
  last_draw_ = now;
  constexpr int kWidth = 30;
  const int filled = steps_in_epoch > 0 ? static_cast<int>(kWidth * step_in_epoch / steps_in_epoch) : kWidth;
  fmt::print("\repoch {}/{} [{}{}] {}/{} loss {:.4f} {:.0f} samples/s ", epoch + 1, epochs_,
             std::string(filled, '#'), std::string(kWidth - filled, '.'), step_in_epoch, steps_in_epoch, read_loss(),
             samples_per_s_);
  std::fflush(stdout);
  bar_open_ = true;
}

void Progress::log(int64_t global_step, double loss, double lr, double samples_per_s,
                   const nlohmann::ordered_json& fields) {
  std::lock_guard lock(mutex_);
  samples_per_s_ = samples_per_s;
  nlohmann::ordered_json entry = {{"event", "step"}, {"step", global_step}, {"epoch", epoch_ + 1}, {"loss", loss},
                                  {"lr", lr}, {"samples_per_s", samples_per_s}};
  for (const auto& [k, v] : fields.items()) entry[k] = v;
  write(entry);
  if (style_ != Style::lines) return;
  std::string times;
  if (fields.contains("step_ms"))
    times = fmt::format(" | ms/step {:.2f}: data {:.2f} fwd {:.2f} bwd {:.2f} comm {:.2f} opt {:.2f}",
                        fields["step_ms"].get<double>(), fields["data_wait_ms"].get<double>(),
                        fields["forward_ms"].get<double>(), fields["backward_ms"].get<double>(),
                        fields["comm_ms"].get<double>(), fields["optimizer_ms"].get<double>());
  // A replayed CUDA graph is the whole step at once.
  if (fields.value("graph_ms", 0.0) > 0) times += fmt::format(" graph {:.2f}", fields["graph_ms"].get<double>());
  fmt::print("epoch {}/{} step {} ({}/{}): loss {:.4f} lr {:.3g} {:.0f} samples/s{}\n", epoch_ + 1, epochs_,
             global_step, step_in_epoch_, steps_in_epoch_, loss, lr, samples_per_s, times);
  std::fflush(stdout);
}

void Progress::finish_bar() {
  if (bar_open_) fmt::print("\n");
  bar_open_ = false;
}

void Progress::end_epoch(int64_t epoch, int64_t epochs, const nlohmann::ordered_json& summary) {
  std::lock_guard lock(mutex_);
  finish_bar();
  write(summary);
  if (style_ == Style::none) return;
  std::string line = fmt::format("epoch {}/{} done:", epoch + 1, epochs);
  for (const auto& [k, v] : summary.items())
    if (k != "event" && k != "epoch") line += fmt::format(" {} {}", k, v.is_number_float() ? fmt::format("{:.4g}", v.get<double>()) : v.dump());
  fmt::print("{}\n", line);
  std::fflush(stdout);
}

void Progress::message(const std::string& text) {
  std::lock_guard lock(mutex_);
  finish_bar();
  if (style_ != Style::none) fmt::print("{}\n", text);
  std::fflush(stdout);
}

void Progress::record(const nlohmann::ordered_json& entry) {
  std::lock_guard lock(mutex_);
  write(entry);
}

void Progress::write(const nlohmann::ordered_json& entry) {
  if (!metrics_.is_open()) return;
  metrics_ << entry.dump() << "\n";
  metrics_.flush();
}

}  // namespace mpt::tools
