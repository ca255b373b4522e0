#pragma once
// What the tools share about their command lines: range checks whose
// failures read as words ("--log-every: must be positive, got 0"; CLI11's
// PositiveNumber prints the limits of a double, 300 digits long), and one
// exit status for every usage error.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace mpt::tools {

// The status a tool ends with when its command line is wrong.
inline constexpr int kUsageError = 2;

// A finite number for which `holds` is true; otherwise the option is
// refused with "<rule>, got <input>" ("must be finite" for inf, 1e999 or
// nan, which the conversion accepts). Text that is no number passes here
// and is refused by the option's own conversion.
template <typename Holds>
CLI::Validator number_where(Holds holds, std::string rule, std::string tag) {
  return CLI::Validator(
      [holds, rule](std::string& input) -> std::string {
        double value = 0;
        if (!CLI::detail::lexical_cast(input, value)) return {};
        if (!std::isfinite(value)) return "must be finite, got " + input;
        return holds(value) ? std::string() : rule + ", got " + input;
      },
      std::move(tag));
}

// A number above 0 (for a count: at least 1).
inline CLI::Validator positive() {
  return number_where([](double v) { return v > 0; }, "must be positive", "POSITIVE");
}

// A number of 0 or more (options where 0 means "off" or "the default").
inline CLI::Validator non_negative() {
  return number_where([](double v) { return v >= 0; }, "must be 0 or more", "NONNEGATIVE");
}

// A number in [0, 1].
inline CLI::Validator fraction() {
  return number_where([](double v) { return v >= 0 && v <= 1; }, "must be in [0, 1]", "FRACTION");
}

// The command-line flag for an options struct's field: "growth_interval" ->
// "--growth-interval", so that the library's own checks name the flag.
inline std::string flag_for_field(std::string_view field) {
  std::string flag = "--" + std::string(field);
  std::replace(flag.begin(), flag.end(), '_', '-');
  return flag;
}

// Parses the command line as CLI11_PARSE does, but a usage error ends the
// tool with kUsageError (not CLI11's 104-109). Returns the status to exit
// with (0 after --help), or nothing when the tool should go on.
inline std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : kUsageError;
  }
  return std::nullopt;
}

}  // namespace mpt::tools
