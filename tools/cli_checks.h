#pragma once
// What the tools share about their command lines: range checks whose
// failures read as words ("--log-every: must be positive, got 0"; CLI11's
// PositiveNumber prints the limits of a double, 300 digits long), and one
// exit status for every usage error.
#include <CLI/CLI.hpp>

#include <optional>
#include <string>

namespace mpt::tools {

// The status a tool ends with when its command line is wrong.
inline constexpr int kUsageError = 2;

// A number above 0 (for a count: at least 1). Text that is no number passes
// here and is refused by the option's own conversion.
inline CLI::Validator positive() {
  return CLI::Validator(
      [](std::string& input) -> std::string {
        double value = 0;
        if (!CLI::detail::lexical_cast(input, value) || value > 0) return {};
        return "must be positive, got " + input;
      },
      "POSITIVE");
}

// A number of 0 or more (options where 0 means "off" or "the default").
inline CLI::Validator non_negative() {
  return CLI::Validator(
      [](std::string& input) -> std::string {
        double value = 0;
        if (!CLI::detail::lexical_cast(input, value) || value >= 0) return {};
        return "must be 0 or more, got " + input;
      },
      "NONNEGATIVE");
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
