#pragma once
// A per-step record of the loss scaler, and writers for it (JSON lines or
// CSV). The scaler hands one row per update() to a sink; the replay tool
// writes its trajectories with the same writer.
//
// Each written row names its policy and leaves out what does not apply to
// it, so that a reader need not know which values are placeholders:
// hysteresis_left only for the hysteresis policy, grad_norm only where it
// was measured (not -1), first_nonfinite only where a gradient was named.
// A JSON line lacks those keys; a CSV row leaves their cells empty. Read
// back, they take the defaults below.
#include <cstdint>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "amp/scale_rule.h"

namespace mpt::amp {

struct ScalerTraceRow {
  int64_t step = 0;               // update() calls before this one
  ScalePolicy policy = ScalePolicy::torch;  // the rule that gave next_scale
  double scale = 0;               // the scale this step's gradients were scaled by
  double next_scale = 0;          // the scale after update()
  int64_t growth_tracker = 0;     // after update()
  int32_t hysteresis_left = 0;    // after update() (hysteresis policy only)
  bool found_inf = false;
  bool skipped = false;           // the optimizer step was skipped
  std::string first_nonfinite;    // name of the first gradient holding inf/NaN ("" if none)
  double grad_norm = -1;          // L2 norm of the unscaled gradients (inf/NaN when found_inf; -1: not measured)
};

// One row as a JSON object on one line (a .jsonl trace's line; the sweep's
// JSON holds its trajectories as these objects).
std::string scaler_trace_row_json(const ScalerTraceRow& row);

using ScalerTraceSink = std::function<void(const ScalerTraceRow&)>;

enum class TraceFormat { jsonl, csv };
// jsonl for paths ending in .jsonl or .json, csv for .csv; ValueError otherwise.
TraceFormat trace_format_for_path(const std::string& path);

// Writes rows to a file as they come (flushed per row, so a crashed run
// keeps its trace). Opening failures throw IOError naming the path.
class ScalerTraceWriter {
 public:
  ScalerTraceWriter(const std::string& path, TraceFormat format);
  explicit ScalerTraceWriter(const std::string& path) : ScalerTraceWriter(path, trace_format_for_path(path)) {}
  void write(const ScalerTraceRow& row);
  // A sink that writes here (the writer must outlive it).
  ScalerTraceSink sink() {
    return [this](const ScalerTraceRow& row) { write(row); };
  }

 private:
  std::string path_;
  TraceFormat format_;
  std::ofstream out_;
};

// Reads a trace written by ScalerTraceWriter (either format; also traces
// written before rows named their policy, which read as torch).
std::vector<ScalerTraceRow> read_scaler_trace(const std::string& path);

}  // namespace mpt::amp
