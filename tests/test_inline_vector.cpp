// InlineVector (the type of Shape) against std::vector: the same values
// after the same operations, inline and past its inline capacity, including
// the ones whose argument is one of its own values.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "tensor/inline_vector.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

using Small = InlineVector<int64_t, 4>;

void expect_same(const Small& v, const std::vector<int64_t>& reference) {
  EXPECT_EQ(std::vector<int64_t>(v.begin(), v.end()), reference);
  EXPECT_EQ(v.size(), reference.size());
  EXPECT_EQ(v.empty(), reference.empty());
  EXPECT_GE(v.capacity(), v.size());
}

// Random operations, applied to both, compared after each: sizes wander
// across the inline capacity and back.
TEST(InlineVector, FollowsStdVectorThroughRandomOperations) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  Small v;
  std::vector<int64_t> r;
  auto pick = [&](size_t n) { return n == 0 ? size_t{0} : static_cast<size_t>(rng() % n); };
  for (int step = 0; step < 4000; ++step) {
    const auto value = static_cast<int64_t>(rng() % 100);
    switch (rng() % 10) {
      case 0:
      case 1:
        v.push_back(value);
        r.push_back(value);
        break;
      case 2:
        if (!r.empty()) {
          v.pop_back();
          r.pop_back();
        }
        break;
      case 3: {
        const size_t at = pick(r.size() + 1);
        v.insert(v.begin() + at, value);
        r.insert(r.begin() + static_cast<std::ptrdiff_t>(at), value);
        break;
      }
      case 4: {
        const size_t at = pick(r.size() + 1), n = pick(4);
        v.insert(v.begin() + at, n, value);
        r.insert(r.begin() + static_cast<std::ptrdiff_t>(at), n, value);
        break;
      }
      case 5:
        if (!r.empty()) {
          const size_t first = pick(r.size()), last = first + pick(r.size() - first + 1);
          v.erase(v.begin() + first, v.begin() + last);
          r.erase(r.begin() + static_cast<std::ptrdiff_t>(first), r.begin() + static_cast<std::ptrdiff_t>(last));
        }
        break;
      case 6: {
        const size_t n = pick(10);
        v.resize(n, value);
        r.resize(n, value);
        break;
      }
      case 7:
        if (!r.empty()) {  // one of its own values, as it grows
          const size_t at = pick(r.size());
          v.push_back(v[at]);
          r.push_back(r[at]);
        }
        break;
      case 8:
        if (!r.empty()) {  // its own values, inserted into itself
          const size_t first = pick(r.size()), last = first + pick(r.size() - first + 1), at = pick(r.size() + 1);
          v.insert(v.begin() + at, v.begin() + first, v.begin() + last);
          const std::vector<int64_t> part(r.begin() + static_cast<std::ptrdiff_t>(first),
                                          r.begin() + static_cast<std::ptrdiff_t>(last));
          r.insert(r.begin() + static_cast<std::ptrdiff_t>(at), part.begin(), part.end());
        }
        break;
      default:
        if (!r.empty()) {  // its own tail, assigned to itself
          const size_t first = pick(r.size());
          v.assign(v.begin() + first, v.end());
          r = std::vector<int64_t>(r.begin() + static_cast<std::ptrdiff_t>(first), r.end());
        }
        break;
    }
    expect_same(v, r);
    if (::testing::Test::HasFailure()) {
      ADD_FAILURE() << "after step " << step;
      return;
    }
  }
}

TEST(InlineVector, CopiesAndMovesInlineAndOnTheHeap) {
  for (const std::vector<int64_t>& values : {std::vector<int64_t>{1, 2, 3}, std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7}}) {
    SCOPED_TRACE(values.size());
    const Small original(values);
    Small copy = original;
    expect_same(copy, values);
    Small moved = std::move(copy);
    expect_same(moved, values);
    expect_same(copy, {});  // NOLINT(bugprone-use-after-move): a moved-from InlineVector is empty
    Small assigned{9};
    assigned = original;
    expect_same(assigned, values);
    Small move_assigned{9, 9, 9, 9, 9, 9};
    move_assigned = std::move(assigned);
    expect_same(move_assigned, values);
    Small other{5};
    other.swap(move_assigned);
    expect_same(other, values);
    expect_same(move_assigned, {5});
    copy = copy;  // NOLINT: self-assignment keeps the values
    other = std::move(other);  // NOLINT
    expect_same(other, values);
    const std::vector<int64_t> back = original;
    EXPECT_EQ(back, values);
  }
}

// Its own values, read backwards (an iterator that is not contiguous), inline and on the heap.
TEST(InlineVector, AssignsItsOwnValuesInAnyOrder) {
  Small inline_values{1, 2, 3};
  inline_values.assign(inline_values.rbegin(), inline_values.rend());
  expect_same(inline_values, {3, 2, 1});
  Small heap_values{1, 2, 3, 4, 5, 6};
  heap_values.assign(heap_values.rbegin(), heap_values.rend());
  expect_same(heap_values, {6, 5, 4, 3, 2, 1});
  heap_values.assign(heap_values.rbegin() + 2, heap_values.rend());
  expect_same(heap_values, {3, 4, 5, 6});
}

TEST(InlineVector, ComparesAndConstructsAsAVector) {
  EXPECT_EQ(Small({1, 2}), Small(std::vector<int64_t>{1, 2}));
  EXPECT_NE(Small({1, 2}), Small({1, 2, 0}));
  EXPECT_LT(Small({1, 2}), Small({1, 3}));
  EXPECT_LT(Small({1, 2}), Small({1, 2, 0}));
  EXPECT_EQ(Small(3, 7), Small({7, 7, 7}));
  EXPECT_EQ(Small(3), Small({0, 0, 0}));
  EXPECT_EQ(Small{}, Small(std::vector<int64_t>{}));
  EXPECT_EQ(Small({1, 2, 3, 4, 5}).at(4), 5);
  EXPECT_THROW(Small({1, 2}).at(2), std::out_of_range);
  const Small v{4, 5, 6};
  EXPECT_EQ(std::vector<int64_t>(v.rbegin(), v.rend()), (std::vector<int64_t>{6, 5, 4}));
  EXPECT_EQ(v.front(), 4);
  EXPECT_EQ(v.back(), 6);
}

}  // namespace
}  // namespace mpt
