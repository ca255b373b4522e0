#pragma once
// What mpt-doctor found, section by section: facts, notes, warnings and
// problems, each warning and problem with its fix in one line. Printed for
// people (default) or as one JSON document (--json).
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace mpt::diag {

enum class Severity { ok, note, warning, problem };
const char* severity_name(Severity s);  // "ok", "note", "warning", "problem"

struct Finding {
  Severity severity = Severity::ok;
  std::string text;
  std::string fix;  // one line; empty for ok and notes
};

struct Section {
  std::string key;    // JSON name: "cuda", "gpus", ...
  std::string title;  // heading for people
  std::vector<Finding> findings;
  nlohmann::ordered_json data = nlohmann::ordered_json::object();  // the facts, for machines

  void ok(std::string text) { findings.push_back({Severity::ok, std::move(text), {}}); }
  void note(std::string text) { findings.push_back({Severity::note, std::move(text), {}}); }
  void warning(std::string text, std::string fix) {
    findings.push_back({Severity::warning, std::move(text), std::move(fix)});
  }
  void problem(std::string text, std::string fix) {
    findings.push_back({Severity::problem, std::move(text), std::move(fix)});
  }
};

class Report {
 public:
  // A new section, appended (the reference stays valid: sections are stable).
  Section& add(const std::string& key, const std::string& title);
  int count(Severity s) const;

  std::string human() const;
  nlohmann::ordered_json json() const;

 private:
  std::vector<std::unique_ptr<Section>> sections_;
};

}  // namespace mpt::diag
