#include "parallel/settings_check.h"

#include <algorithm>
#include <optional>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "parallel/distributed_error.h"

namespace mpt::dist {
namespace {

std::string encode(const Settings& settings) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& [name, value] : settings) j.push_back({name, value});
  // Replaced, not refused: a value may hold bytes that are not UTF-8 (a path).
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

Settings decode(const std::string& text, int rank) {
  Settings out;
  try {
    for (const nlohmann::json& entry : nlohmann::json::parse(text))
      out.emplace_back(entry.at(0).get<std::string>(), entry.at(1).get<std::string>());
  } catch (const nlohmann::json::exception& e) {
    throw DistributedError(fmt::format("check_same_settings: rank {}'s settings are not readable: {}", rank, e.what()));
  }
  return out;
}

// "rank 3", "ranks 0, 2, 5".
std::string ranks_text(const std::vector<int>& ranks) {
  return fmt::format("rank{} {}", ranks.size() > 1 ? "s" : "", fmt::join(ranks, ", "));
}

// How long rank 0 waits, when the settings differ, for the other ranks to
// have read them all before its error ends the process hosting the store.
constexpr Millis kReadGrace = std::chrono::seconds(10);

}  // namespace

std::string describe_differences(const std::vector<Settings>& per_rank) {
  std::vector<std::string> names;  // in the order the ranks list them
  std::set<std::string> seen;
  for (const Settings& settings : per_rank)
    for (const auto& [name, value] : settings)
      if (seen.insert(name).second) names.push_back(name);

  std::vector<std::string> lines;
  for (const std::string& name : names) {
    // Each value (none: the rank lacks the setting) with the ranks that have it.
    std::vector<std::pair<std::optional<std::string>, std::vector<int>>> groups;
    for (size_t r = 0; r < per_rank.size(); ++r) {
      std::optional<std::string> value;
      for (const auto& [n, v] : per_rank[r])
        if (n == name) value = v;
      auto group = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == value; });
      if (group == groups.end()) group = groups.insert(groups.end(), {value, {}});
      group->second.push_back(static_cast<int>(r));
    }
    if (groups.size() == 1) continue;
    std::vector<std::string> parts;
    for (const auto& [value, ranks] : groups)
      parts.push_back(value ? fmt::format("'{}' on {}", *value, ranks_text(ranks))
                            : fmt::format("not given on {}", ranks_text(ranks)));
    lines.push_back(fmt::format("{}: {}", name, fmt::join(parts, ", ")));
  }
  if (lines.empty()) return "";
  return fmt::format("the ranks' settings differ: {}", fmt::join(lines, "; "));
}

void check_same_settings(Store& store, int rank, int world_size, const Settings& mine) {
  check<ValueError>(world_size >= 1 && rank >= 0 && rank < world_size,
                    "check_same_settings: rank {} is not in a world of {}", rank, world_size);
  // Each call is a round of its own, so that a later check never reads an
  // earlier one's values.
  const int64_t round = store.add(fmt::format("mpt/settings/calls/{}", rank), 1);
  auto key = [round](int r) { return fmt::format("mpt/settings/{}/{}", round, r); };
  store.set(key(rank), encode(mine));

  std::vector<Settings> all(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) {
    if (r == rank) {
      all[r] = mine;
      continue;
    }
    try {
      store.wait({key(r)});
    } catch (const TimeoutError&) {
      throw TimeoutError(fmt::format("check_same_settings on rank {}: rank {} gave no settings within {} ms (it is "
                                     "still starting, stalled, or does not check its settings)",
                                     rank, r, store.timeout().count()));
    }
    all[r] = decode(store.get_string(key(r)), r);
  }
  const std::string read_key = fmt::format("mpt/settings/{}/read", round);
  store.add(read_key, 1);
  const std::string differences = describe_differences(all);
  if (differences.empty()) return;
  // Rank 0's process hosts a TCP store: its error must not end the store
  // before every rank has read what it needs to say the same.
  if (rank == 0) {
    const auto until = std::chrono::steady_clock::now() + std::min(kReadGrace, store.timeout());
    while (store.add(read_key, 0) < world_size && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  throw DistributedError(
      fmt::format("rank {} of {}: {}. Every rank of a job must be started with the same settings", rank, world_size,
                  differences));
}

}  // namespace mpt::dist
