// Data: IDX files (good and crafted bad ones), Fashion-MNIST, the
// character-level text set, samplers against PyTorch's written rules, and
// the DataLoader's order, prefetch bound, resume position and errors.
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <set>

#include "models/char_dataset.h"
#include "models/data_fingerprint.h"
#include "models/data_loader.h"
#include "tensor/pinned.h"
#include "models/fashion_mnist.h"
#include "models/idx_file.h"
#include "tests/test_util.h"

namespace mpt::data {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::expect_contains;

using Bytes = std::vector<uint8_t>;

void write_plain(const std::string& path, const Bytes& bytes) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

void write_gz(const std::string& path, const Bytes& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
  gzclose(f);
}

// An IDX file of unsigned bytes with the given sizes; values count up from 0.
Bytes idx_bytes(const std::vector<uint32_t>& dims) {
  Bytes b = {0, 0, 0x08, static_cast<uint8_t>(dims.size())};
  size_t n = 1;
  for (uint32_t d : dims) {
    for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<uint8_t>(d >> s));
    n *= d;
  }
  for (size_t i = 0; i < n; ++i) b.push_back(static_cast<uint8_t>(i * 7));
  return b;
}

std::string idx_error(const std::string& path) {
  try {
    read_idx(path);
  } catch (const IOError& e) {
    return e.what();
  }
  ADD_FAILURE() << "read_idx('" << path << "') did not throw IOError";
  return "";
}

// ---- IDX -----------------------------------------------------------------------------------

TEST(IdxFile, ReadsPlainAndGzippedFiles) {
  mpt::testing::TempDir dir{"mpt-data-test"};
  const Bytes bytes = idx_bytes({3, 2, 5});
  write_plain(dir.file("a.idx"), bytes);
  write_gz(dir.file("a.idx.gz"), bytes);
  for (const char* name : {"a.idx", "a.idx.gz"}) {
    const IdxArray a = read_idx(dir.file(name));
    EXPECT_EQ(a.shape, (std::vector<int64_t>{3, 2, 5})) << name;
    EXPECT_EQ(a.values, Bytes(bytes.begin() + 16, bytes.end())) << name;
  }
}

TEST(IdxFile, MalformedFilesNameTheFileAndTheFault) {
  mpt::testing::TempDir dir{"mpt-data-test"};
  const Bytes good = idx_bytes({4, 3});
  auto with = [&](const std::string& name, Bytes b, bool gz = true) {
    const std::string p = dir.file(name);
    if (gz) write_gz(p, b); else write_plain(p, b);
    return p;
  };
  Bytes bad_magic = good;
  bad_magic[0] = 0x1f;
  Bytes bad_type = good;
  bad_type[2] = 0x0D;
  Bytes zero_rank = good;
  zero_rank[3] = 0;
  Bytes zero_dim = good;
  zero_dim[7] = 0;
  const Bytes short_header(good.begin(), good.begin() + 6);
  const Bytes short_data(good.begin(), good.end() - 5);
  Bytes trailing = good;
  trailing.push_back(1);

  std::string p = with("magic.gz", bad_magic);
  expect_contains(idx_error(p), {p, "magic"});
  p = with("type.gz", bad_type);
  expect_contains(idx_error(p), {p, "0x0d"});
  p = with("rank.gz", zero_rank);
  expect_contains(idx_error(p), {p, "0 dimensions"});
  p = with("dim.gz", zero_dim);
  expect_contains(idx_error(p), {p, "size 0"});
  p = with("header.gz", short_header);
  expect_contains(idx_error(p), {p, "header"});
  p = with("data.gz", short_data);
  expect_contains(idx_error(p), {p, "truncated", "7 of 12"});
  p = with("trailing.gz", trailing);
  expect_contains(idx_error(p), {p, "after"});
  // Sizes whose product wraps around 2^64 (to 0) are refused before the product.
  Bytes wraps = {0, 0, 0x08, 4};
  for (uint32_t d : {65536u, 65536u, 4u, 1u << 30})
    for (int s = 24; s >= 0; s -= 8) wraps.push_back(static_cast<uint8_t>(d >> s));
  p = with("wraps", wraps, false);
  expect_contains(idx_error(p), {p, "implausible"});
  p = with("tiny", Bytes{0, 0}, false);
  expect_contains(idx_error(p), {p, "too short"});
  expect_contains(idx_error(dir.file("missing.gz")), {"cannot open", "missing.gz"});

  // A gzip stream cut in half: zlib's complaint, with the file name.
  write_gz(dir.file("whole.gz"), idx_bytes({64, 64}));
  std::ifstream in(dir.file("whole.gz"), std::ios::binary);
  Bytes gz((std::istreambuf_iterator<char>(in)), {});
  p = with("cut.gz", Bytes(gz.begin(), gz.begin() + gz.size() / 2), false);
  expect_contains(idx_error(p), {p, "ends inside its gzip stream"});
  // Its eight-byte trailer (CRC-32 and length) missing: every data byte
  // arrived, but nothing vouches for them.
  p = with("no_trailer.gz", Bytes(gz.begin(), gz.end() - 8), false);
  expect_contains(idx_error(p), {p, "ends inside its gzip stream"});
  // A CRC-32 that does not match the data.
  Bytes flipped = gz;
  flipped[flipped.size() - 8] ^= 0x40;
  p = with("flipped.gz", flipped, false);
  expect_contains(idx_error(p), {p, "not a readable gzip file", "incorrect data check"});
  // Bytes after the stream that start no other member (gzread ignored them).
  for (const Bytes& junk : {Bytes{0}, Bytes{'j', 'u', 'n', 'k'}, Bytes{0x1f, 0x8b}}) {
    Bytes followed = gz;
    followed.insert(followed.end(), junk.begin(), junk.end());
    p = with("junk.gz", followed, false);
    expect_contains(idx_error(p), {p, "after the end of its gzip stream"});
  }
}

// Gzip members back to back (`cat a.gz b.gz`) are one stream, as gzip reads them.
TEST(IdxFile, ReadsGzipMembersBackToBack) {
  mpt::testing::TempDir dir{"mpt-data-test"};
  const Bytes bytes = idx_bytes({40, 30});
  const size_t half = bytes.size() / 2;
  write_gz(dir.file("first.gz"), Bytes(bytes.begin(), bytes.begin() + half));
  write_gz(dir.file("second.gz"), Bytes(bytes.begin() + half, bytes.end()));
  auto contents = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return Bytes((std::istreambuf_iterator<char>(in)), {});
  };
  Bytes both = contents(dir.file("first.gz"));
  const Bytes second = contents(dir.file("second.gz"));
  both.insert(both.end(), second.begin(), second.end());
  write_plain(dir.file("both.gz"), both);
  const IdxArray a = read_idx(dir.file("both.gz"));
  EXPECT_EQ(a.shape, (std::vector<int64_t>{40, 30}));
  EXPECT_EQ(a.values, Bytes(bytes.begin() + 12, bytes.end()));
}

// ---- Fashion-MNIST ---------------------------------------------------------------------------

TEST(FashionMnist, HasTheDocumentedSizesAndBalancedClasses) {
  if (!fs::exists(kFashionMnistDir)) GTEST_SKIP() << "skipped: " << kFashionMnistDir << " not installed";
  const FashionMNIST train(Split::train), test(Split::test);
  ASSERT_EQ(train.size(), 60000);
  ASSERT_EQ(test.size(), 10000);
  // The data set's documented make-up: 6000 training and 1000 test images per class.
  for (const auto* set : {&train, &test}) {
    std::vector<int64_t> all(static_cast<size_t>(set->size()));
    std::iota(all.begin(), all.end(), int64_t{0});
    const Batch b = set->get_batch(all);
    EXPECT_EQ(b.input.shape(), (Shape{set->size(), 1, 28, 28}));
    std::vector<int64_t> per_class(10);
    for (int64_t y : b.target.to_vector<int64_t>()) per_class.at(static_cast<size_t>(y))++;
    for (int64_t c : per_class) EXPECT_EQ(c, set->size() / 10);
  }
  // Normalised pixels: (0/255 - mean)/std .. (1 - mean)/std.
  const auto x = train.get_batch({0, 1, 2}).input.to_vector<float>();
  const auto [lo, hi] = std::minmax_element(x.begin(), x.end());
  EXPECT_NEAR(*lo, -FashionMNIST::kMean / FashionMNIST::kStd, 1e-6);
  EXPECT_LE(*hi, (1 - FashionMNIST::kMean) / FashionMNIST::kStd + 1e-6);
  EXPECT_THROW(train.get_batch({60000}), ValueError);
}

TEST(FashionMnist, MissingDirectoryIsAnIOError) {
  try {
    FashionMNIST(Split::test, "/nonexistent/fmnist");
    FAIL();
  } catch (const IOError& e) {
    expect_contains(e.what(), {"/nonexistent/fmnist/t10k-images-idx3-ubyte.gz"});
  }
}

TEST(FashionMnist, FilesOfTheWrongKindAreRefusedNamingThem) {
  // A folder laid out like the data set, with the files wrong one at a time.
  auto images = [](uint32_t n) { return idx_bytes({n, 28, 28}); };
  auto labels = [](uint32_t n, uint8_t last) {  // 0, 1, ..., then `last`
    Bytes b = {0, 0, 0x08, 1, 0, 0, 0, static_cast<uint8_t>(n)};
    for (uint32_t i = 0; i + 1 < n; ++i) b.push_back(static_cast<uint8_t>(i));
    b.push_back(last);
    return b;
  };
  struct Case {
    Bytes img, lab;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      {images(4), labels(4, 9), {}},                                                      // the good layout
      {idx_bytes({4, 28, 27}), labels(4, 9), {"t10k-images-idx3-ubyte.gz", "[4, 28, 27]", "[N, 28, 28]"}},
      {labels(4, 9), labels(4, 9), {"t10k-images-idx3-ubyte.gz", "[4]", "[N, 28, 28]"}},  // labels given as images
      {images(4), labels(3, 9), {"t10k-labels-idx1-ubyte.gz", "[3]", "expected [4]"}},
      {images(4), labels(4, 10), {"t10k-labels-idx1-ubyte.gz", "label 10 at index 3", "0..9"}},
  };
  for (const Case& c : cases) {
    mpt::testing::TempDir dir{"mpt-data-test"};
    write_gz(dir.file("t10k-images-idx3-ubyte.gz"), c.img);
    write_gz(dir.file("t10k-labels-idx1-ubyte.gz"), c.lab);
    if (c.says.empty()) {
      EXPECT_EQ(FashionMNIST(Split::test, dir.file("")).size(), 4);
      continue;
    }
    try {
      FashionMNIST(Split::test, dir.file(""));
      ADD_FAILURE() << "accepted a bad data set; expected: " << c.says.front();
    } catch (const IOError& e) {
      expect_contains(e.what(), c.says);
    }
  }
}

// ---- text ---------------------------------------------------------------------------------------

TEST(CharDataset, WindowsAndShiftedTargets) {
  const std::string text = "hello world";
  const CharDataset ds(text, 4, "inline");
  EXPECT_EQ(ds.vocabulary(), " dehlorw");
  EXPECT_EQ(ds.size(), 11 - 4);
  const Batch b = ds.get_batch({0, 6});
  EXPECT_EQ(b.input.shape(), (Shape{2, 4}));
  const auto x = b.input.to_vector<int64_t>(), y = b.target.to_vector<int64_t>();
  EXPECT_EQ(ds.decode({x.begin(), x.begin() + 4}), "hell");
  EXPECT_EQ(ds.decode({y.begin(), y.begin() + 4}), "ello");
  EXPECT_EQ(ds.decode({x.begin() + 4, x.end()}), "worl");
  EXPECT_EQ(ds.decode({y.begin() + 4, y.end()}), "orld");
  EXPECT_THROW(ds.get_batch({7}), ValueError);

  const CharDataset tail = ds.subset(5, 2);  // windows "world"[0..4) and [1..5)
  EXPECT_EQ(tail.size(), 2);
  EXPECT_EQ(tail.vocabulary(), ds.vocabulary());
  const auto tx = tail.get_batch({1}).input.to_vector<int64_t>();
  EXPECT_EQ(tail.decode(tx), "worl");
  EXPECT_THROW(ds.subset(5, 3), ValueError);
  EXPECT_THROW(CharDataset("abc", 3, "short"), IOError);
}

TEST(CharDataset, EncodesWhatItDecodes) {
  const CharDataset ds("hello world", 4, "inline");
  EXPECT_EQ(ds.encode("hello"), (std::vector<int64_t>{3, 2, 4, 4, 5}));  // " dehlorw"
  EXPECT_EQ(ds.decode(ds.encode("low rod")), "low rod");
  EXPECT_TRUE(ds.encode("").empty());
  expect_contains(error_of<ValueError>([&] { ds.encode("hex"); }),
                  {"CharDataset::encode", "byte 2 of 'hex' (0x78)", "not in the vocabulary"});
}

// Every byte of the text distinct, so each token is its byte's position:
// the training windows' last target comes before the held-out windows'
// first input, and between them the sets cover every window that can.
TEST(CharDataset, AHeldOutTailSharesNoByteWithTraining) {
  std::string text;
  for (int b = 0; b < 200; ++b) text.push_back(static_cast<char>(b));
  const int64_t context = 16, held_out = 20;
  const CharDataset whole(text, context, "positions");
  const auto [train, eval] = whole.split_held_out(held_out);
  EXPECT_EQ(eval.size(), held_out);
  EXPECT_EQ(train.size() + context + eval.size(), whole.size());
  auto all = [](const CharDataset& ds) {
    std::vector<int64_t> every(ds.size());
    for (int64_t i = 0; i < ds.size(); ++i) every[i] = i;
    return ds.get_batch(every);
  };
  const Batch trained = all(train), held = all(eval);
  const auto read_in_training = trained.target.to_vector<int64_t>();
  const auto held_inputs = held.input.to_vector<int64_t>();
  EXPECT_EQ(*std::max_element(read_in_training.begin(), read_in_training.end()) + 1,
            *std::min_element(held_inputs.begin(), held_inputs.end()))
      << "training reads up to the byte before the held-out text, and no further";
  EXPECT_THROW(whole.split_held_out(whole.size() - context), ValueError);  // nothing left to train on
}

TEST(CharDataset, UnusableTextFilesAreRefusedNamingThem) {
  mpt::testing::TempDir dir{"mpt-data-test"};
  write_plain(dir.file("empty.txt"), {});
  write_plain(dir.file("short.txt"), {'a', 'b', 'c'});
  fs::create_directories(dir.file("folder.txt"));
  auto error_for = [](const std::string& path) {
    try {
      CharDataset ds(path, 8);
      ADD_FAILURE() << "accepted '" << path << "'";
    } catch (const IOError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  expect_contains(error_for(dir.file("empty.txt")), {dir.file("empty.txt"), "0 bytes", "context of 8"});
  expect_contains(error_for(dir.file("short.txt")), {dir.file("short.txt"), "3 bytes"});
  expect_contains(error_for(dir.file("folder.txt")), {dir.file("folder.txt"), "is a folder"});
  expect_contains(error_for(dir.file("missing.txt")), {dir.file("missing.txt"), "cannot open"});
}

TEST(CharDataset, ReadsTheDefaultCorpus) {
  if (!fs::exists(kDefaultTextCorpus)) GTEST_SKIP() << "skipped: " << kDefaultTextCorpus << " not installed";
  const CharDataset ds(kDefaultTextCorpus, 64);
  EXPECT_GT(ds.size(), 10000);
  EXPECT_GT(ds.vocab_size(), 40);
  EXPECT_LE(ds.vocab_size(), 256);
}

// ---- samplers ----------------------------------------------------------------------------------

TEST(Samplers, ShuffleIsASeededPermutationPerEpoch) {
  const SequentialOrRandomSampler s(1000, true, 42);
  const auto e0 = s.indices(0), e1 = s.indices(1);
  EXPECT_EQ(std::set<int64_t>(e0.begin(), e0.end()).size(), 1000u);
  EXPECT_EQ(*std::max_element(e0.begin(), e0.end()), 999);
  EXPECT_EQ(e0, SequentialOrRandomSampler(1000, true, 42).indices(0));  // reproducible
  EXPECT_NE(e0, e1);                                                    // reshuffled per epoch
  EXPECT_NE(e0, SequentialOrRandomSampler(1000, true, 43).indices(0));
  const auto seq = SequentialOrRandomSampler(5, false).indices(3);
  EXPECT_EQ(seq, (std::vector<int64_t>{0, 1, 2, 3, 4}));
}

// PyTorch's DistributedSampler, restated: pad the epoch's order with its
// own beginning to total = ceil(n / world) * world; rank r takes [r::world].
TEST(Samplers, DistributedShardsFollowPyTorchsRule) {
  for (int64_t n : {10, 12, 3}) {
    for (int world : {1, 3, 4}) {
      const auto order = SequentialOrRandomSampler(n, true, 7).indices(5);
      const int64_t per_rank = (n + world - 1) / world;
      std::vector<int64_t> padded = order;
      while (static_cast<int64_t>(padded.size()) < per_rank * world) padded.push_back(order[padded.size() - n]);
      std::multiset<int64_t> covered;
      for (int r = 0; r < world; ++r) {
        const auto shard = DistributedSampler(n, world, r, true, 7).indices(5);
        std::vector<int64_t> expected;
        for (size_t i = static_cast<size_t>(r); i < padded.size(); i += world) expected.push_back(padded[i]);
        EXPECT_EQ(shard, expected) << "n " << n << " world " << world << " rank " << r;
        covered.insert(shard.begin(), shard.end());
      }
      for (int64_t i = 0; i < n; ++i) EXPECT_GE(covered.count(i), 1u);
    }
  }
  // drop_last: the order cut to floor(n / world) * world; rank r takes [r::world].
  const auto order = SequentialOrRandomSampler(10, true, 1).indices(0);
  for (int r = 0; r < 4; ++r) {
    const auto shard = DistributedSampler(10, 4, r, true, 1, true).indices(0);
    EXPECT_EQ(shard, (std::vector<int64_t>{order[r], order[r + 4]})) << "rank " << r;
  }
  EXPECT_NE(DistributedSampler(100, 2, 0, true, 1).indices(0), DistributedSampler(100, 2, 0, true, 1).indices(1));
  EXPECT_THROW(DistributedSampler(10, 2, 2), ValueError);
}

// ---- DataLoader ----------------------------------------------------------------------------------

// Sample i is the input i with the target -i (so that a loader that mixes
// the two up is seen); counts its requests and can fail on one index.
class CountingDataset : public Dataset {
 public:
  explicit CountingDataset(int64_t n, int64_t fail_at = -1) : n_(n), fail_at_(fail_at) {}
  int64_t size() const override { return n_; }
  Batch get_batch(const std::vector<int64_t>& indices) const override {
    requests_++;
    std::vector<int64_t> v(indices.begin(), indices.end());
    for (int64_t i : v)
      if (i == fail_at_) throw IOError(fmt::format("CountingDataset: sample {} is unreadable", i));
    std::vector<int64_t> negated(v.size());
    std::transform(v.begin(), v.end(), negated.begin(), [](int64_t i) { return -i; });
    return {from_vector(v, {static_cast<int64_t>(v.size())}, DType::i64),
            from_vector(negated, {static_cast<int64_t>(negated.size())}, DType::i64)};
  }
  mutable std::atomic<int> requests_{0};

 private:
  int64_t n_, fail_at_;
};

// The inputs of every batch left in the epoch; each target must be their negation.
std::vector<std::vector<int64_t>> drain(DataLoader& loader) {
  std::vector<std::vector<int64_t>> out;
  while (auto b = loader.next()) {
    out.push_back(b->input.to_vector<int64_t>());
    std::vector<int64_t> negated = out.back();
    for (int64_t& i : negated) i = -i;
    EXPECT_EQ(b->target.to_vector<int64_t>(), negated);
  }
  return out;
}

TEST(DataLoaderTest, BatchesFollowTheSamplerWhateverTheWorkerCount) {
  auto ds = std::make_shared<CountingDataset>(103);
  auto sampler = std::make_shared<SequentialOrRandomSampler>(103, true, 9);
  const auto order = sampler->indices(2);
  std::vector<std::vector<int64_t>> expected;
  for (size_t i = 0; i < order.size(); i += 10)
    expected.emplace_back(order.begin() + i, order.begin() + std::min(order.size(), i + 10));
  for (int workers : {0, 1, 3}) {
    DataLoader loader(ds, sampler, {.batch_size = 10, .num_workers = workers, .prefetch = 2});
    EXPECT_EQ(loader.batches_per_epoch(), 11);
    loader.start_epoch(2);
    EXPECT_EQ(drain(loader), expected) << workers << " workers";
    EXPECT_FALSE(loader.next().has_value());
  }
  DataLoader dropping(ds, sampler, {.batch_size = 10, .drop_last = true, .num_workers = 2});
  dropping.start_epoch(2);
  expected.pop_back();
  EXPECT_EQ(drain(dropping), expected);
}

// Pinned batches (page-locked where a GPU exists) hold the same values.
TEST(DataLoaderTest, PinnedBatchesMatchPlainOnes) {
  auto ds = std::make_shared<CountingDataset>(53);
  auto sampler = std::make_shared<SequentialOrRandomSampler>(53, true, 4);
  DataLoader plain(ds, sampler, {.batch_size = 8, .num_workers = 2});
  DataLoader pinned(ds, sampler, {.batch_size = 8, .num_workers = 2, .pin_memory = true});
  plain.start_epoch(0);
  pinned.start_epoch(0);
  while (auto a = plain.next()) {
    const auto b = pinned.next();
    ASSERT_TRUE(b.has_value());
    EXPECT_EQ(b->input.to_vector<int64_t>(), a->input.to_vector<int64_t>());
    EXPECT_EQ(b->target.to_vector<double>(), a->target.to_vector<double>());
    EXPECT_EQ(is_pinned(b->input), cuda_device_count() > 0);
  }
  EXPECT_FALSE(pinned.next().has_value());
}

TEST(DataLoaderTest, PrefetchStaysBounded) {
  auto ds = std::make_shared<CountingDataset>(1000);
  DataLoader loader(ds, std::make_shared<SequentialOrRandomSampler>(1000, false), {.batch_size = 10, .num_workers = 3,
                                                                                   .prefetch = 4});
  for (int consumed = 1; consumed <= 5; ++consumed) {
    ASSERT_TRUE(loader.next().has_value());
    // Workers may have started at most `prefetch` batches beyond the ones taken.
    EXPECT_LE(ds->requests_.load(), consumed + 4);
  }
}

TEST(DataLoaderTest, ResumingAtASavedPositionContinuesTheSameSequence) {
  auto ds = std::make_shared<CountingDataset>(57);
  auto sampler = std::make_shared<SequentialOrRandomSampler>(57, true, 3);
  DataLoader full(ds, sampler, {.batch_size = 8, .num_workers = 2});
  full.start_epoch(1);
  const auto all = drain(full);

  DataLoader first(ds, sampler, {.batch_size = 8, .num_workers = 2});
  first.start_epoch(1);
  first.next();
  first.next();
  first.next();
  const DataPosition pos = first.position();
  EXPECT_EQ(pos.epoch, 1);
  EXPECT_EQ(pos.batch, 3);

  DataLoader resumed(ds, sampler, {.batch_size = 8, .num_workers = 1});
  resumed.start_epoch(pos.epoch, pos.batch);
  EXPECT_EQ(drain(resumed), std::vector<std::vector<int64_t>>(all.begin() + 3, all.end()));
  EXPECT_THROW(resumed.start_epoch(0, 9), ValueError);
}

TEST(DataLoaderTest, AWorkerFailureSurfacesAtItsBatch) {
  auto ds = std::make_shared<CountingDataset>(40, /*fail_at=*/25);
  DataLoader loader(ds, std::make_shared<SequentialOrRandomSampler>(40, false), {.batch_size = 10, .num_workers = 2});
  EXPECT_TRUE(loader.next().has_value());
  EXPECT_TRUE(loader.next().has_value());
  try {
    loader.next();
    FAIL() << "no error";
  } catch (const IOError& e) {
    expect_contains(e.what(), {"sample 25"});
  }
}

// Without workers too, a batch that fails to load is not consumed: asking
// again fails again at the same batch, and the position stays before it.
TEST(DataLoaderTest, AFailedBatchIsNotSkippedWithoutWorkers) {
  auto ds = std::make_shared<CountingDataset>(40, /*fail_at=*/25);
  DataLoader loader(ds, std::make_shared<SequentialOrRandomSampler>(40, false), {.batch_size = 10, .num_workers = 0});
  ASSERT_TRUE(loader.next().has_value());
  ASSERT_TRUE(loader.next().has_value());
  for (int attempt = 0; attempt < 2; ++attempt) {
    EXPECT_THROW(loader.next(), IOError);
    EXPECT_EQ(loader.position().batch, 2);
  }
}

// A sampler whose epochs differ in length.
class ShrinkingSampler : public Sampler {
 public:
  std::vector<int64_t> indices(int64_t epoch) const override {
    std::vector<int64_t> out(static_cast<size_t>(epoch == 0 ? 40 : 15));
    for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<int64_t>(i);
    return out;
  }
};

// Refused before anything changes: the epoch under way goes on.
TEST(DataLoaderTest, AnEpochOfAnotherLengthIsRefused) {
  for (int workers : {0, 2}) {
    SCOPED_TRACE(fmt::format("{} workers", workers));
    DataLoader loader(std::make_shared<CountingDataset>(40, /*fail_at=*/-1), std::make_shared<ShrinkingSampler>(),
                      {.batch_size = 10, .num_workers = workers});
    ASSERT_TRUE(loader.next().has_value());
    try {
      loader.start_epoch(1);
      FAIL() << "no error";
    } catch (const ValueError& e) {
      expect_contains(e.what(), {"start_epoch", "15 indices for epoch 1", "40 for epoch 0"});
    }
    EXPECT_EQ(loader.position().epoch, 0);
    EXPECT_EQ(loader.position().batch, 1);
    for (int b = 1; b < 4; ++b) {
      const std::optional<Batch> batch = loader.next();
      ASSERT_TRUE(batch.has_value()) << "batch " << b;
      EXPECT_EQ(batch->input.to_vector<int64_t>()[0], 10 * b);
    }
    EXPECT_FALSE(loader.next().has_value());
  }
}

// A data set's fingerprint is what its bytes are: equal for a copy under
// another name, different for other bytes under the same name (one byte
// changed, or one appended), and an unreadable file is named.
TEST(ContentFingerprint, FollowsTheBytesNotTheNames) {
  testing::TempDir dir("fingerprint-test");
  const std::string a = dir.file("a.txt"), b = dir.file("b.txt");
  std::ofstream(a) << "the quick brown fox";
  std::ofstream(b) << "the quick brown fox";
  const std::string first = content_fingerprint({a});
  EXPECT_EQ(first, content_fingerprint({b}));
  EXPECT_EQ(first.rfind("19 bytes, crc32 ", 0), 0u) << first;
  EXPECT_EQ(content_fingerprint({a, b}).rfind("38 bytes, crc32 ", 0), 0u);
  std::ofstream(b) << "the quick brown fix";
  EXPECT_NE(content_fingerprint({b}), first);
  std::ofstream(b) << "the quick brown fox.";
  EXPECT_NE(content_fingerprint({b}), first);
  // Whole-file CRC-32 of the well-known check string.
  std::ofstream(b) << "123456789";
  EXPECT_EQ(content_fingerprint({b}), "9 bytes, crc32 cbf43926");
  expect_contains(error_of<IOError>([&] { content_fingerprint({dir.file("missing.txt")}); }),
                  {"content_fingerprint: cannot open", "missing.txt"});
}

}  // namespace
}  // namespace mpt::data
