#pragma once
// A one-line progress bar on standard error, drawn only when that is a
// terminal (logs and pipes stay clean).
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

namespace mpt::tools {

class ProgressBar {
 public:
  ProgressBar(std::string label, int64_t total)
      : label_(std::move(label)), total_(total), enabled_(isatty(STDERR_FILENO) && total > 0) {}
  ~ProgressBar() { finish(); }

  // Ends the bar's line (before printing anything else).
  void finish() {
    if (enabled_ && drawn_ >= 0) std::fputc('\n', stderr);
    enabled_ = false;
  }

  void update(int64_t done) {
    if (!enabled_) return;
    const int width = 40;
    const int filled = static_cast<int>(width * done / total_);
    const int percent = static_cast<int>(100 * done / total_);
    if (percent == drawn_) return;  // redraw only when the number changes
    drawn_ = percent;
    std::fprintf(stderr, "\r%s [%s%s] %3d%% (%lld/%lld)", label_.c_str(), std::string(filled, '#').c_str(),
                 std::string(width - filled, ' ').c_str(), percent, static_cast<long long>(done),
                 static_cast<long long>(total_));
    std::fflush(stderr);
  }

 private:
  std::string label_;
  int64_t total_;
  bool enabled_;
  int drawn_ = -1;
};

}  // namespace mpt::tools
