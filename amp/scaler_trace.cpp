#include "amp/scaler_trace.h"

#include <cmath>
#include <limits>
#include <map>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "amp/grad_scaler.h"
#include "tensor/error.h"

namespace mpt::amp {
namespace {

constexpr const char* kCsvHeader =
    "step,policy,scale,next_scale,growth_tracker,hysteresis_left,found_inf,skipped,first_nonfinite,grad_norm";

// The columns a CSV trace must have; the others (policy, hysteresis_left,
// first_nonfinite, grad_norm) may be missing or empty.
constexpr const char* kRequiredColumns[] = {"step", "scale", "next_scale", "growth_tracker", "found_inf", "skipped"};

bool has_hysteresis(const ScalerTraceRow& r) { return r.policy == ScalePolicy::hysteresis; }
bool has_grad_norm(const ScalerTraceRow& r) { return r.grad_norm != -1; }

// JSON has no inf/NaN: a norm that is not finite is written as a string.
nlohmann::json number_or_string(double v) {
  if (std::isfinite(v)) return v;
  if (std::isnan(v)) return "nan";
  return v > 0 ? "inf" : "-inf";
}

double parse_double(const std::string& s) {
  if (s == "nan") return std::numeric_limits<double>::quiet_NaN();
  if (s == "inf") return std::numeric_limits<double>::infinity();
  if (s == "-inf") return -std::numeric_limits<double>::infinity();
  size_t used = 0;
  const double v = std::stod(s, &used);
  if (used != s.size()) throw std::invalid_argument(s);
  return v;
}

double json_double(const nlohmann::json& v) { return v.is_string() ? parse_double(v.get<std::string>()) : v.get<double>(); }

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

std::vector<std::string> split_csv(const std::string& line) {
  std::vector<std::string> fields(1);
  bool quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c == '"' && i + 1 < line.size() && line[i + 1] == '"') fields.back() += '"', ++i;
      else if (c == '"') quoted = false;
      else fields.back() += c;
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      fields.emplace_back();
    } else {
      fields.back() += c;
    }
  }
  return fields;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A CSV flag as written (1, 0) or as a spreadsheet may save it (true, false).
bool csv_flag(const std::string& field, const char* name) {
  if (field == "1" || field == "true" || field == "TRUE") return true;
  if (field == "0" || field == "false" || field == "FALSE") return false;
  throw std::invalid_argument(fmt::format("{} must be 1 or 0, got '{}'", name, field));
}

}  // namespace

TraceFormat trace_format_for_path(const std::string& path) {
  if (ends_with(path, ".jsonl") || ends_with(path, ".json")) return TraceFormat::jsonl;
  if (ends_with(path, ".csv")) return TraceFormat::csv;
  throw ValueError(fmt::format("scaler trace: cannot tell the format of '{}' (name it .jsonl or .csv)", path));
}

ScalerTraceWriter::ScalerTraceWriter(const std::string& path, TraceFormat format)
    : path_(path), format_(format), out_(path) {
  check<IOError>(out_.good(), "scaler trace: cannot open '{}' for writing", path);
  if (format_ == TraceFormat::csv) out_ << kCsvHeader << '\n' << std::flush;
}

std::string scaler_trace_row_json(const ScalerTraceRow& r) {
  nlohmann::ordered_json j = {{"step", r.step},
                              {"policy", scale_policy_name(r.policy)},
                              {"scale", r.scale},
                              {"next_scale", r.next_scale},
                              {"growth_tracker", r.growth_tracker}};
  if (has_hysteresis(r)) j["hysteresis_left"] = r.hysteresis_left;
  j["found_inf"] = r.found_inf;
  j["skipped"] = r.skipped;
  if (!r.first_nonfinite.empty()) j["first_nonfinite"] = r.first_nonfinite;
  if (has_grad_norm(r)) j["grad_norm"] = number_or_string(r.grad_norm);
  return j.dump();
}

void ScalerTraceWriter::write(const ScalerTraceRow& r) {
  if (format_ == TraceFormat::jsonl) {
    out_ << scaler_trace_row_json(r) << '\n';
  } else {
    out_ << fmt::format("{},{},{},{},{},{},{},{},{},{}\n", r.step, scale_policy_name(r.policy), r.scale, r.next_scale,
                        r.growth_tracker, has_hysteresis(r) ? std::to_string(r.hysteresis_left) : "",
                        r.found_inf ? 1 : 0, r.skipped ? 1 : 0, csv_field(r.first_nonfinite),
                        has_grad_norm(r) ? fmt::format("{}", r.grad_norm) : "");
  }
  out_.flush();
  check<IOError>(out_.good(), "scaler trace: writing step {} to '{}' failed", r.step, path_);
}

std::vector<ScalerTraceRow> read_scaler_trace(const std::string& path) {
  std::ifstream in(path);
  check<IOError>(in.good(), "scaler trace: cannot open '{}' for reading", path);
  std::vector<ScalerTraceRow> rows;
  std::string line;
  int64_t line_nr = 0;
  // A CSV trace's columns by name (its header line), so that traces written
  // before the policy column read too; empty for JSON lines.
  std::map<std::string, size_t> columns;
  while (std::getline(in, line)) {
    ++line_nr;
    if (!line.empty() && line.back() == '\r') line.pop_back();  // a file saved with Windows line ends
    if (line.empty()) continue;
    if (rows.empty() && columns.empty() && line.starts_with("step,")) {
      const auto names = split_csv(line);
      for (size_t i = 0; i < names.size(); ++i) columns[names[i]] = i;
      for (const char* name : kRequiredColumns)
        check<IOError>(columns.count(name) != 0, "scaler trace: '{}' has no {} column (its header: {})", path, name,
                       line);
      continue;
    }
    ScalerTraceRow r;
    try {
      if (!columns.empty()) {
        const auto f = split_csv(line);
        if (f.size() != columns.size())
          throw std::invalid_argument(fmt::format("expected {} fields, got {}", columns.size(), f.size()));
        // The cell of a column, "" where the trace has no such column.
        auto cell = [&](const char* name) -> const std::string& {
          static const std::string none;
          const auto it = columns.find(name);
          return it == columns.end() ? none : f[it->second];
        };
        r.step = std::stoll(cell("step"));
        if (!cell("policy").empty()) r.policy = scale_policy_from_name(cell("policy"));
        r.scale = parse_double(cell("scale"));
        r.next_scale = parse_double(cell("next_scale"));
        r.growth_tracker = std::stoll(cell("growth_tracker"));
        if (!cell("hysteresis_left").empty()) r.hysteresis_left = std::stoi(cell("hysteresis_left"));
        r.found_inf = csv_flag(cell("found_inf"), "found_inf");
        r.skipped = csv_flag(cell("skipped"), "skipped");
        r.first_nonfinite = cell("first_nonfinite");
        if (!cell("grad_norm").empty()) r.grad_norm = parse_double(cell("grad_norm"));
      } else {
        const auto j = nlohmann::json::parse(line);
        r.step = j.at("step").get<int64_t>();
        if (j.contains("policy")) r.policy = scale_policy_from_name(j.at("policy").get<std::string>());
        r.scale = json_double(j.at("scale"));
        r.next_scale = json_double(j.at("next_scale"));
        r.growth_tracker = j.at("growth_tracker").get<int64_t>();
        if (j.contains("hysteresis_left")) r.hysteresis_left = j.at("hysteresis_left").get<int32_t>();
        r.found_inf = j.at("found_inf").get<bool>();
        r.skipped = j.at("skipped").get<bool>();
        if (j.contains("first_nonfinite")) r.first_nonfinite = j.at("first_nonfinite").get<std::string>();
        if (j.contains("grad_norm")) r.grad_norm = json_double(j.at("grad_norm"));
      }
    } catch (const std::exception& e) {
      throw IOError(fmt::format("scaler trace: '{}' line {} is malformed ({}): {}", path, line_nr, e.what(), line));
    }
    rows.push_back(std::move(r));
  }
  return rows;
}

}  // namespace mpt::amp
