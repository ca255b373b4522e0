// check_same_settings: ranks (threads here, each with its own connection to
// one TCP store) that agree return; ranks that differ all end with one
// message naming each differing setting with every rank's value, and a
// rank that never comes ends the others at the store's timeout.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "parallel/distributed_error.h"
#include "parallel/loopback_stores.h"
#include "parallel/settings_check.h"

namespace mpt::dist {
namespace {

// Runs check_same_settings on every rank at once; each rank's error
// message, or "" where it returned.
std::vector<std::string> check_on_every_rank(const std::vector<Settings>& per_rank, Millis timeout = Millis(20000)) {
  const int world = static_cast<int>(per_rank.size());
  const auto stores = loopback_stores(world, timeout);
  std::vector<std::string> errors(world);
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r)
    ranks.emplace_back([&, r] {
      try {
        check_same_settings(*stores[r], r, world, per_rank[r]);
      } catch (const DistributedError& e) {
        errors[r] = e.what();
      }
    });
  for (std::thread& t : ranks) t.join();
  return errors;
}

TEST(SettingsCheck, RanksThatAgreeGoOnAndMayCheckAgain) {
  const Settings same = {{"model", "mlp"}, {"batch size", "128"}};
  for (const std::string& error : check_on_every_rank({same, same, same})) EXPECT_EQ(error, "");
  // A second round on the same store reads its own values, not the first's.
  const int world = 2;
  const auto stores = loopback_stores(world, Millis(20000));
  std::vector<std::string> errors(world);
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r)
    ranks.emplace_back([&, r] {
      try {
        check_same_settings(*stores[r], r, world, {{"round", "1"}});
        check_same_settings(*stores[r], r, world, {{"round", r == 0 ? "2a" : "2b"}});
      } catch (const DistributedError& e) {
        errors[r] = e.what();
      }
    });
  for (std::thread& t : ranks) t.join();
  for (const std::string& error : errors) EXPECT_NE(error.find("round: '2a' on rank 0, '2b' on rank 1"), std::string::npos) << error;
}

TEST(SettingsCheck, EveryRankNamesEachDifferenceWithEachRanksValue) {
  const std::vector<Settings> per_rank = {
      {{"precision", "fp16"}, {"batch size", "128"}, {"seed", "0"}},
      {{"precision", "bf16"}, {"batch size", "128"}, {"seed", "0"}},
      {{"precision", "fp16"}, {"batch size", "64"}, {"seed", "0"}},
      {{"precision", "bf16"}, {"batch size", "128"}},
  };
  const auto errors = check_on_every_rank(per_rank);
  for (int r = 0; r < 4; ++r) {
    SCOPED_TRACE(r);
    EXPECT_NE(errors[r].find(fmt::format("rank {} of 4: the ranks' settings differ", r)), std::string::npos)
        << errors[r];
    EXPECT_NE(errors[r].find("precision: 'fp16' on ranks 0, 2, 'bf16' on ranks 1, 3"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("batch size: '128' on ranks 0, 1, 3, '64' on rank 2"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("seed: '0' on ranks 0, 1, 2, not given on rank 3"), std::string::npos) << errors[r];
  }
}

TEST(SettingsCheck, DescribeDifferencesIsEmptyWhenAllAgree) {
  EXPECT_EQ(describe_differences({{{"a", "1"}}, {{"a", "1"}}}), "");
  EXPECT_EQ(describe_differences({{{"a", "1"}}, {{"a", "2"}}}), "the ranks' settings differ: a: '1' on rank 0, '2' on rank 1");
  EXPECT_EQ(describe_differences({{{"a", "1"}}, {}}), "the ranks' settings differ: a: '1' on rank 0, not given on rank 1");
}

TEST(SettingsCheck, ARankThatNeverComesEndsTheOthersAtTheTimeout) {
  const auto stores = loopback_stores(2, Millis(300));
  const auto started = std::chrono::steady_clock::now();
  try {
    check_same_settings(*stores[0], 0, 2, {{"a", "1"}});
    FAIL() << "returned without rank 1";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 gave no settings within 300 ms"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(5));
  EXPECT_THROW(check_same_settings(*stores[0], 2, 2, {}), ValueError);
}

}  // namespace
}  // namespace mpt::dist
