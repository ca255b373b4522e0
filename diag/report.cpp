#include "diag/report.h"

#include <fmt/format.h>

namespace mpt::diag {

const char* severity_name(Severity s) {
  switch (s) {
    case Severity::ok: return "ok";
    case Severity::note: return "note";
    case Severity::warning: return "warning";
    case Severity::problem: return "problem";
  }
  return "?";
}

Section& Report::add(const std::string& key, const std::string& title) {
  sections_.push_back(std::make_unique<Section>());
  sections_.back()->key = key;
  sections_.back()->title = title;
  return *sections_.back();
}

int Report::count(Severity s) const {
  int n = 0;
  for (const auto& section : sections_)
    for (const auto& f : section->findings) n += f.severity == s;
  return n;
}

std::string Report::human() const {
  std::string out;
  for (const auto& section : sections_) {
    out += fmt::format("{}\n", section->title);
    for (const auto& f : section->findings) {
      const char* tag = f.severity == Severity::ok        ? "  ok      "
                        : f.severity == Severity::note    ? "  note    "
                        : f.severity == Severity::warning ? "  WARNING "
                                                          : "  PROBLEM ";
      out += fmt::format("{}{}\n", tag, f.text);
      if (!f.fix.empty()) out += fmt::format("            fix: {}\n", f.fix);
    }
    out += "\n";
  }
  const int problems = count(Severity::problem), warnings = count(Severity::warning);
  if (problems + warnings == 0)
    out += "No problems found.\n";
  else
    out += fmt::format("{} problem{}, {} warning{}; each has its fix above.\n", problems, problems == 1 ? "" : "s",
                       warnings, warnings == 1 ? "" : "s");
  return out;
}

nlohmann::ordered_json Report::json() const {
  nlohmann::ordered_json out;
  out["problems"] = count(Severity::problem);
  out["warnings"] = count(Severity::warning);
  nlohmann::ordered_json findings = nlohmann::ordered_json::array();
  for (const auto& section : sections_) {
    out[section->key] = section->data;
    for (const auto& f : section->findings) {
      nlohmann::ordered_json j = {{"section", section->key}, {"severity", severity_name(f.severity)}, {"text", f.text}};
      if (!f.fix.empty()) j["fix"] = f.fix;
      findings.push_back(std::move(j));
    }
  }
  out["findings"] = std::move(findings);
  return out;
}

}  // namespace mpt::diag
