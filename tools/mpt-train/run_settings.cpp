#include "tools/mpt-train/run_settings.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tensor/error.h"

namespace mpt::tools {
namespace {

// A value as a message shows it: text quoted, numbers as written.
std::string shown(const nlohmann::json& value) {
  return value.is_string() ? fmt::format("'{}'", value.get<std::string>()) : value.dump();
}

// A value as the ranks compare it: text as it is, numbers as written.
std::string plain(const nlohmann::json& value) {
  return value.is_string() ? value.get<std::string>() : value.dump();
}

}  // namespace

nlohmann::ordered_json saved_options(const TrainConfig& c) {
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  for_each_option(c, [&](const char* name, const auto& field, OnResume on_resume, bool) {
    if (on_resume != OnResume::not_saved) out[name] = field;
  });
  return out;
}

void take_saved_options(TrainConfig& c, const nlohmann::json& saved) {
  for_each_option(c, [&](const char* name, auto& field, OnResume on_resume, bool) {
    if (on_resume == OnResume::not_saved || c.given.count(name) || !saved.contains(name)) return;
    try {
      field = saved.at(name).get<std::remove_reference_t<decltype(field)>>();
    } catch (const nlohmann::json::exception&) {
      throw ValueError(fmt::format("mpt-train: the checkpoint's run configuration holds --{} {}, which is not a value "
                                   "of that option",
                                   name, saved.at(name).dump()));
    }
    c.settled.insert(name);
  });
}

void check_fixed_options(const TrainConfig& c, const nlohmann::json& saved, const std::string& source) {
  for_each_option(c, [&](const char* name, const auto& field, OnResume on_resume, bool) {
    if (on_resume != OnResume::fixed || !c.given.count(name) || !saved.contains(name)) return;
    const nlohmann::json mine = field;
    check(mine == saved.at(name),
          "mpt-train: --resume '{}': --{} {} differs from the run in the checkpoint, which has {}; leave the option "
          "out to continue that run (options that may change when resuming: {})",
          source, name, shown(mine), shown(saved.at(name)), options_that_may_change());
  });
}

dist::Settings rank_settings(const TrainConfig& c) {
  dist::Settings out;
  for_each_option(c, [&](const char* name, const auto& field, OnResume, bool same_on_every_rank) {
    if (same_on_every_rank) out.emplace_back(fmt::format("--{}", name), plain(field));
  });
  return out;
}

std::string options_that_may_change() {
  std::vector<std::string> names;
  const TrainConfig defaults;
  for_each_option(defaults, [&](const char* name, const auto&, OnResume on_resume, bool) {
    if (on_resume == OnResume::kept) names.push_back(fmt::format("--{}", name));
  });
  return fmt::format("{}", fmt::join(names, ", "));
}

}  // namespace mpt::tools
