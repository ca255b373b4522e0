// The host block cache: large CPU buffers reused instead of mapped afresh.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "tensor/cpu/host_block_cache.h"
#include "tensor/memory.h"
#include "tensor/tensor.h"

namespace mpt {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

// Each test starts from an empty cache with a known limit and puts the
// limit back after.
class HostBlockCache : public ::testing::Test {
 protected:
  void SetUp() override {
    saved_limit_ = host_cache::limit();
    host_cache::set_limit(256 * kMiB);
    empty_cache();
  }
  void TearDown() override { host_cache::set_limit(saved_limit_); }

 private:
  size_t saved_limit_ = 0;
};

TEST_F(HostBlockCache, AFreedTensorsBlockServesTheNextOfItsClass) {
  const MemoryStats before = memory_stats(kCPU);
  const void* first = nullptr;
  {
    Tensor a = Tensor::empty({4, kMiB / 4}, DType::f32, kCPU);  // 4 MiB
    first = a.data_ptr();
    EXPECT_EQ(memory_stats(kCPU).allocated_bytes, before.allocated_bytes + 4 * kMiB);
  }
  const MemoryStats freed = memory_stats(kCPU);
  EXPECT_EQ(freed.allocated_bytes, before.allocated_bytes);
  EXPECT_EQ(freed.reserved_bytes, before.reserved_bytes + 4 * kMiB);  // kept
  // 4 MiB - 100 bytes rounds to the same class: the same block, no new system allocation.
  Tensor b = Tensor::empty({4 * kMiB - 100}, DType::u8, kCPU);
  EXPECT_EQ(b.data_ptr(), first);
  const MemoryStats reused = memory_stats(kCPU);
  EXPECT_EQ(reused.num_device_mallocs, freed.num_device_mallocs);
  EXPECT_EQ(reused.num_allocs, freed.num_allocs + 1);
  // Another class is not served by it.
  Tensor c = Tensor::empty({6 * kMiB}, DType::u8, kCPU);
  EXPECT_EQ(memory_stats(kCPU).num_device_mallocs, reused.num_device_mallocs + 1);
}

TEST_F(HostBlockCache, SizeClassesAreAtMostAnEighthOverTheRequest) {
  std::mt19937_64 rng(7);
  size_t previous = 0;
  for (size_t n = kMiB - 4096; n < kMiB + 4096; n += 64) {  // across the cached threshold
    const size_t r = host_cache::rounded_size(n);
    EXPECT_GE(r, n);
    EXPECT_GE(r, previous) << n;
    EXPECT_EQ(r % 64, 0u);
    previous = r;
  }
  for (int i = 0; i < 2000; ++i) {
    const size_t n = kMiB + rng() % (size_t{1} << 34);
    const size_t r = host_cache::rounded_size(n);
    EXPECT_GE(r, n);
    EXPECT_LE(r, n + n / 8) << n;
    EXPECT_EQ(host_cache::rounded_size(r), r) << n;  // a class is its own class
  }
  EXPECT_EQ(host_cache::rounded_size(kMiB + 1), kMiB + kMiB / 8);
  EXPECT_EQ(host_cache::rounded_size(100), 128u);
}

TEST_F(HostBlockCache, ARequestTooLargeToRoundIsRefused) {
  const MemoryStats before = memory_stats(kCPU);
  EXPECT_THROW(host_cache::allocate(~size_t{0} - 8), OutOfMemoryError);
  EXPECT_EQ(memory_stats(kCPU).allocated_bytes, before.allocated_bytes);
}

TEST_F(HostBlockCache, TheLimitBoundsWhatIsKeptAndZeroKeepsNothing) {
  host_cache::set_limit(20 * kMiB);
  const MemoryStats before = memory_stats(kCPU);
  {
    std::vector<Tensor> blocks;
    for (int i = 0; i < 3; ++i) blocks.push_back(Tensor::empty({16 * kMiB}, DType::u8, kCPU));
  }
  MemoryStats after = memory_stats(kCPU);
  EXPECT_EQ(after.reserved_bytes - after.allocated_bytes, 16 * kMiB);  // one of three fits under 20 MiB
  EXPECT_EQ(after.num_device_frees, before.num_device_frees + 2);

  host_cache::set_limit(0);  // lowering the limit frees what is over it
  after = memory_stats(kCPU);
  EXPECT_EQ(after.reserved_bytes, after.allocated_bytes);
  { Tensor t = Tensor::empty({2 * kMiB}, DType::u8, kCPU); }
  EXPECT_EQ(memory_stats(kCPU).reserved_bytes, memory_stats(kCPU).allocated_bytes);
}

TEST_F(HostBlockCache, EmptyCacheGivesEveryCachedBlockBack) {
  { Tensor a = Tensor::empty({3 * kMiB}, DType::u8, kCPU), b = Tensor::empty({5 * kMiB}, DType::u8, kCPU); }
  MemoryStats s = memory_stats(kCPU);
  ASSERT_GT(s.reserved_bytes, s.allocated_bytes);
  empty_cache();
  s = memory_stats(kCPU);
  EXPECT_EQ(s.reserved_bytes, s.allocated_bytes);
  reset_peak_memory_stats(kCPU);
  EXPECT_EQ(memory_stats(kCPU).peak_allocated_bytes, memory_stats(kCPU).allocated_bytes);
}

TEST_F(HostBlockCache, SmallBuffersBypassIt) {
  const MemoryStats before = memory_stats(kCPU);
  { Tensor t = Tensor::empty({1000}, DType::f32, kCPU); }
  EXPECT_EQ(memory_stats(kCPU).num_allocs, before.num_allocs);
}

// Threads allocating, filling and checking blocks of a few classes at once:
// no block is handed to two holders, and every byte goes back.
TEST_F(HostBlockCache, ThreadsSharingItNeverShareABlock) {
  const MemoryStats before = memory_stats(kCPU);
  std::vector<std::thread> threads;
  std::vector<int> bad(4, 0);
  for (int id = 0; id < 4; ++id) {
    threads.emplace_back([id, &bad] {
      std::mt19937 rng(id);
      for (int i = 0; i < 60; ++i) {
        const size_t n = kMiB * (1 + rng() % 3);
        const auto mark = static_cast<unsigned char>(id * 61 + i);
        void* p = host_cache::allocate(n);
        std::memset(p, mark, n);
        std::this_thread::yield();
        const auto* bytes = static_cast<const unsigned char*>(p);
        for (size_t k = 0; k < n; k += 4093) bad[id] += bytes[k] != mark;
        host_cache::release(p, n);
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int id = 0; id < 4; ++id) EXPECT_EQ(bad[id], 0) << "thread " << id;
  const MemoryStats after = memory_stats(kCPU);
  EXPECT_EQ(after.allocated_bytes, before.allocated_bytes);
  EXPECT_EQ(after.num_allocs, before.num_allocs + 240);
  EXPECT_LT(after.num_device_mallocs - before.num_device_mallocs, 240u);  // reuse happened
}

}  // namespace
}  // namespace mpt
