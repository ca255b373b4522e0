#include "amp/scaler_replay.h"

#include <fstream>
#include <random>

#include "tensor/error.h"

namespace mpt::amp {
namespace {

void check_steps(const char* fn, int64_t steps) { check(steps >= 0, "{}: steps must be >= 0, got {}", fn, steps); }

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t\r");
  if (a == std::string::npos) return {};
  return s.substr(a, s.find_last_not_of(" \t\r") - a + 1);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts(1);
  for (char c : s) {
    if (c == sep) parts.emplace_back();
    else parts.back() += c;
  }
  return parts;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

std::vector<bool> bernoulli_overflows(int64_t steps, double p, uint64_t seed) {
  check_steps("bernoulli_overflows", steps);
  check(p >= 0 && p <= 1, "bernoulli_overflows: p must be in [0, 1], got {}", p);
  // The draws are mt19937_64's (whose numbers the standard fixes), each
  // turned into a uniform double in [0, 1) by its top 53 bits, not
  // std::bernoulli_distribution, whose algorithm each standard library
  // picks: a seed gives the same pattern wherever the tool was built.
  std::mt19937_64 rng(seed);
  std::vector<bool> out(static_cast<size_t>(steps));
  for (auto&& v : out) v = static_cast<double>(rng() >> 11) * 0x1.0p-53 < p;
  return out;
}

std::vector<bool> burst_overflows(int64_t steps, int64_t every, int64_t length) {
  check_steps("burst_overflows", steps);
  check(every >= 1 && length >= 1 && length <= every,
        "burst_overflows: need 1 <= length <= every, got every {} length {}", every, length);
  std::vector<bool> out(static_cast<size_t>(steps));
  for (int64_t i = 0; i < steps; ++i) out[i] = (i + 1) % every < length && i + 1 >= every;
  return out;
}

std::vector<bool> periodic_overflows(int64_t steps, int64_t period) {
  check(period >= 1, "periodic_overflows: period must be >= 1, got {}", period);
  return burst_overflows(steps, period, 1);
}

std::vector<bool> read_overflow_pattern(const std::string& path) {
  if (ends_with(path, ".jsonl") || ends_with(path, ".json") || ends_with(path, ".csv")) {
    std::vector<bool> out;
    for (const ScalerTraceRow& r : read_scaler_trace(path)) out.push_back(r.found_inf);
    return out;
  }
  std::ifstream in(path);
  check<IOError>(in.good(), "read_overflow_pattern: cannot open '{}'", path);
  std::vector<bool> out;
  std::string line;
  int64_t line_nr = 0;
  while (std::getline(in, line)) {
    ++line_nr;
    const std::string v = trim(line.substr(0, line.find('#')));
    if (v.empty()) continue;
    if (v == "1" || v == "true") out.push_back(true);
    else if (v == "0" || v == "false") out.push_back(false);
    else throw IOError(fmt::format("read_overflow_pattern: '{}' line {}: expected 0 or 1, got '{}'", path, line_nr, v));
  }
  return out;
}

std::vector<bool> overflow_pattern_from_spec(const std::string& spec, int64_t steps, uint64_t seed) {
  const auto colon = spec.find(':');
  const std::string kind = spec.substr(0, colon);
  const std::string rest = colon == std::string::npos ? "" : spec.substr(colon + 1);
  const auto args = split(rest, ':');
  // Whole numbers only: "10abc" or "3.7" as a count is refused, not read as 10 or 3.
  auto whole = [](const std::string& text, auto parse) {
    size_t used = 0;
    const auto value = parse(text, &used);
    if (used != text.size()) throw std::invalid_argument(text);
    return value;
  };
  const auto real = [](const std::string& t, size_t* used) { return std::stod(t, used); };
  const auto count = [](const std::string& t, size_t* used) { return std::stoll(t, used); };
  try {
    if (kind == "bernoulli" && args.size() == 1) return bernoulli_overflows(steps, whole(args[0], real), seed);
    if (kind == "bursts" && args.size() == 2)
      return burst_overflows(steps, whole(args[0], count), whole(args[1], count));
    if (kind == "periodic" && args.size() == 1) return periodic_overflows(steps, whole(args[0], count));
  } catch (const std::logic_error&) {
    // a number that does not parse: reported below with the expected forms
  }
  if (kind == "file" && !rest.empty()) return read_overflow_pattern(rest);
  throw ValueError(fmt::format(
      "overflow pattern '{}' not understood (expected bernoulli:P, bursts:EVERY:LENGTH, periodic:PERIOD or file:PATH)",
      spec));
}

std::vector<ScalerTraceRow> replay_overflows(const GradScalerOptions& options, const std::vector<bool>& overflows) {
  const ScaleRule rule = scale_rule_from(options);
  ScaleState state{static_cast<float>(options.init_scale), 0, options.hysteresis};
  std::vector<ScalerTraceRow> rows;
  rows.reserve(overflows.size());
  for (size_t i = 0; i < overflows.size(); ++i) {
    ScalerTraceRow r;
    r.step = static_cast<int64_t>(i);
    r.policy = options.policy;
    r.scale = state.scale;
    update_scale(rule, overflows[i], 1, state);
    r.next_scale = state.scale;
    r.growth_tracker = state.growth_tracker;
    r.hysteresis_left = state.hysteresis_left;
    r.found_inf = r.skipped = overflows[i];  // no gradients: grad_norm stays -1 (not measured)
    rows.push_back(std::move(r));
  }
  return rows;
}

}  // namespace mpt::amp
