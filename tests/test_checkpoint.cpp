// Checkpoints: the safetensors layout against the format's written rules,
// round trips, refusal of truncated, corrupted and mismatched files with
// nothing loaded, an interrupted save that leaves the old file intact, and
// a restored run that continues bit-identically.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <random>
#include <thread>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "autograd/ops.h"
#include "models/adamw.h"
#include "models/checkpoint.h"
#include "models/mlp.h"
#include "models/sgd.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::expect_contains;
using Bytes = std::vector<uint8_t>;

class CheckpointTest : public ::testing::Test {
 protected:
  std::string file(const std::string& name) const { return dir_.file(name); }
  mpt::testing::TempDir dir_{"mpt-ckpt-test"};
};

Bytes read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes((std::istreambuf_iterator<char>(in)), {});
}
void write_bytes(const std::string& path, const Bytes& b) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), b.size());
}
// A safetensors file's start: the header's length (8 bytes, little-endian),
// then the header.
Bytes framed_header(const std::string& header) {
  Bytes b;
  for (int i = 0; i < 8; ++i) b.push_back(static_cast<uint8_t>(header.size() >> (8 * i)));
  for (char c : header) b.push_back(static_cast<uint8_t>(c));
  return b;
}

std::vector<std::pair<std::string, std::vector<double>>> values_of(const OrderedDict<Tensor>& d) {
  std::vector<std::pair<std::string, std::vector<double>>> out;
  for (const auto& [k, t] : d) out.emplace_back(k, t.to_vector<double>());
  return out;
}

// ---- the file format -----------------------------------------------------------------------

TEST_F(CheckpointTest, FileFollowsTheSafetensorsLayout) {
  const Tensor a = from_vector(std::vector<float>{1.5f, -2.0f, 3.25f, 0.0f, 5.0f, 6.0f}, {2, 3}, kCPU);
  const Tensor b = from_vector(std::vector<int64_t>{7}, {}, DType::i64);
  io::save_safetensors(file("x.safetensors"), {{"a", a}, {"b", b}}, {{"note", "hi"}});
  const Bytes bytes = read_bytes(file("x.safetensors"));
  // 8-byte little-endian header length, JSON header, then the data.
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{bytes[i]} << (8 * i);
  ASSERT_LE(8 + n, bytes.size());
  EXPECT_EQ((8 + n) % 8, 0u);  // data aligned
  const auto header = nlohmann::json::parse(std::string(bytes.begin() + 8, bytes.begin() + 8 + n));
  EXPECT_EQ(header["a"]["dtype"], "F32");
  EXPECT_EQ(header["a"]["shape"], nlohmann::json({2, 3}));
  EXPECT_EQ(header["b"]["dtype"], "I64");
  EXPECT_EQ(header["b"]["shape"], nlohmann::json::array());
  EXPECT_EQ(header["__metadata__"]["note"], "hi");
  const uint64_t a0 = header["a"]["data_offsets"][0], a1 = header["a"]["data_offsets"][1];
  const uint64_t b0 = header["b"]["data_offsets"][0];
  EXPECT_EQ(a1 - a0, 24u);
  float first;
  std::memcpy(&first, bytes.data() + 8 + n + a0, 4);
  EXPECT_EQ(first, 1.5f);
  int64_t seven;
  std::memcpy(&seven, bytes.data() + 8 + n + b0, 8);
  EXPECT_EQ(seven, 7);
  EXPECT_EQ(bytes.size(), 8 + n + 24 + 8);
}

TEST_F(CheckpointTest, ReadsAFileWrittenByHandFromTheSpec) {
  // As another writer would produce it: no checksum, tensors not in name order.
  const std::string header = R"({"w":{"dtype":"F16","shape":[2],"data_offsets":[8,12]},)"
                             R"("v":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}})";
  Bytes b = framed_header(header);
  for (uint8_t x : {3, 0, 0, 0, 0xfe, 0xff, 0xff, 0xff}) b.push_back(x);  // i32 3, -2
  for (uint8_t x : {0x00, 0x3c, 0x00, 0xc0}) b.push_back(x);              // f16 1.0, -2.0
  write_bytes(file("hand.safetensors"), b);
  const io::TensorFile f = io::load_safetensors(file("hand.safetensors"));
  EXPECT_FALSE(f.had_checksum);
  EXPECT_EQ(f.tensors.keys(), (std::vector<std::string>{"v", "w"}));  // file order
  EXPECT_EQ(f.tensors.at("v").to_vector<int64_t>(), (std::vector<int64_t>{3, -2}));
  EXPECT_EQ(f.tensors.at("w").to_vector<double>(), (std::vector<double>{1.0, -2.0}));
}

// float8 under the names Hugging Face's safetensors (and PyTorch through
// it) use, F8_E4M3 and F8_E5M2: a file written by another writer reads, and
// every code of both formats survives a round trip.
TEST_F(CheckpointTest, Float8UsesTheSafetensorsNamesAndKeepsEveryCode) {
  const std::string header = R"({"a":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]},)"
                             R"("b":{"dtype":"F8_E5M2","shape":[2],"data_offsets":[2,4]}})";
  Bytes b = framed_header(header);
  for (uint8_t x : {0x38, 0xC0, 0x3C, 0xC0}) b.push_back(x);  // e4m3 1.0, -2.0; e5m2 1.0, -2.0
  write_bytes(file("hand.safetensors"), b);
  const io::TensorFile f = io::load_safetensors(file("hand.safetensors"));
  EXPECT_EQ(f.tensors.at("a").dtype(), DType::e4m3);
  EXPECT_EQ(f.tensors.at("b").dtype(), DType::e5m2);
  EXPECT_EQ(f.tensors.at("a").to_vector<double>(), (std::vector<double>{1.0, -2.0}));
  EXPECT_EQ(f.tensors.at("b").to_vector<double>(), (std::vector<double>{1.0, -2.0}));

  OrderedDict<Tensor> in;
  for (DType t : {DType::e4m3, DType::e5m2}) {
    Tensor codes = Tensor::empty({16, 16}, t);
    for (int c = 0; c < 256; ++c) static_cast<uint8_t*>(codes.data_ptr())[c] = static_cast<uint8_t>(c);
    in.insert(dtype_name(t), codes);
  }
  io::save_safetensors(file("f8.safetensors"), in);
  const Bytes bytes = read_bytes(file("f8.safetensors"));
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{bytes[i]} << (8 * i);
  const auto json = nlohmann::json::parse(std::string(bytes.begin() + 8, bytes.begin() + 8 + n));
  EXPECT_EQ(json["e4m3"]["dtype"], "F8_E4M3");
  EXPECT_EQ(json["e5m2"]["dtype"], "F8_E5M2");
  const io::TensorFile out = io::load_safetensors(file("f8.safetensors"));
  for (const auto& [k, t] : in) {
    const Tensor& u = out.tensors.at(k);
    ASSERT_EQ(u.dtype(), t.dtype()) << k;
    ASSERT_EQ(u.shape(), t.shape()) << k;
    EXPECT_EQ(std::memcmp(u.data_ptr(), t.data_ptr(), 256), 0) << k;
  }
}

TEST_F(CheckpointTest, RoundTripKeepsEveryDTypeBitForBit) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  OrderedDict<Tensor> in;
  for (DType t : {DType::f32, DType::f16, DType::bf16, DType::f64})
    in.insert(dtype_name(t), prim::to(randn({3, 4}, DType::f32, kCPU, &gen), t));
  in.insert("i32", from_vector(std::vector<int32_t>{-1, 2}, {2}, DType::i32));
  in.insert("u8", from_vector(std::vector<int32_t>{0, 255}, {2}, DType::u8));
  in.insert("scalar", scalar_tensor(0.1, DType::f64));
  in.insert("empty", zeros({0, 5}));
  in.insert("view", prim::transpose(randn({2, 3}, DType::f32, kCPU, &gen), 0, 1));  // not contiguous
  io::save_safetensors(file("r.safetensors"), in, {{"k", "v"}});
  const io::TensorFile out = io::load_safetensors(file("r.safetensors"));
  EXPECT_TRUE(out.had_checksum);
  EXPECT_EQ(out.metadata, (io::Metadata{{"k", "v"}}));
  ASSERT_EQ(out.tensors.keys(), in.keys());
  for (const auto& [k, t] : in) {
    const Tensor& u = out.tensors.at(k);
    EXPECT_EQ(u.dtype(), t.dtype()) << k;
    EXPECT_EQ(u.shape(), t.shape()) << k;
    EXPECT_EQ(u.to_vector<double>(), t.to_vector<double>()) << k;
  }
}

// ---- refusals ------------------------------------------------------------------------------------

TEST_F(CheckpointTest, TruncatedAndCorruptedFilesAreRefused) {
  Generator gen(3);
  auto mlp = nn::make_mlp({.in_features = 6, .hidden = {5}, .num_classes = 3}, &gen);
  optim::AdamW opt(mlp->parameters());
  const std::string path = file("c.safetensors");
  ckpt::save_checkpoint(path, ckpt::capture(*mlp, opt, 4, {1, 2}, gen));
  const Bytes good = read_bytes(path);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{good[i]} << (8 * i);

  const std::string bad = file("bad.safetensors");
  for (size_t keep : {size_t{0}, size_t{5}, size_t{8 + n / 2}, size_t(8 + n), good.size() - 1}) {
    write_bytes(bad, Bytes(good.begin(), good.begin() + keep));
    const std::string e = error_of<IOError>([&] { ckpt::read_checkpoint(bad); });
    expect_contains(e, {bad});
    SCOPED_TRACE(e);
  }
  // One flipped bit in the data, in a header digit, in the metadata.
  auto flipped = [&](size_t at) {
    Bytes b = good;
    b[at] ^= 0x10;
    write_bytes(bad, b);
    return error_of<IOError>([&] { ckpt::read_checkpoint(bad); });
  };
  expect_contains(flipped(good.size() - 3), {bad, "corrupted", "checksum"});
  expect_contains(flipped(8 + n + 1), {bad, "corrupted"});
  const std::string text(good.begin() + 8, good.begin() + 8 + n);
  const size_t step_at = text.find("\"step\":\"4\"") + 8;  // the digit 4
  ASSERT_NE(step_at, std::string::npos + 8);
  expect_contains(flipped(8 + step_at), {bad});
  expect_contains(flipped(8 + text.find('{')), {bad, "malformed JSON"});
  // A padding space turned into a NUL, which ends the JSON parser's input
  // and so changes nothing it reads.
  ASSERT_EQ(text.back(), ' ') << "this header has no padding";
  Bytes nul = good;
  nul[8 + n - 1] = 0;
  write_bytes(bad, nul);
  expect_contains(error_of<IOError>([&] { ckpt::read_checkpoint(bad); }), {bad, "corrupted", "header bytes"});

  // Data appended after the last tensor.
  Bytes longer = good;
  longer.push_back(0);
  write_bytes(bad, longer);
  expect_contains(error_of<IOError>([&] { ckpt::read_checkpoint(bad); }), {"extra bytes"});

  // A folder where a file should be (`--resume ckpts/`).
  fs::create_directories(file("folder.safetensors"));
  expect_contains(error_of<IOError>([&] { ckpt::read_checkpoint(file("folder.safetensors")); }),
                  {file("folder.safetensors"), "is not a file"});
}

// Headers no safetensors writer makes: nested a million levels deep (whose
// dump in a message would recurse a million times), with a key an entry
// cannot have, or with a shape of a million sizes (named, not printed whole).
TEST_F(CheckpointTest, HeadersOfNoSafetensorsShapeAreRefused) {
  auto load_header = [&](const std::string& header) {
    write_bytes(file("odd.safetensors"), framed_header(header));
    return error_of<IOError>([&] { io::load_safetensors(file("odd.safetensors")); });
  };
  const size_t deep = 1000000;
  const std::string nested = std::string(deep, '[') + std::string(deep, ']');
  expect_contains(load_header(R"({"w":{"dtype":"F32","shape":)" + nested + R"(,"data_offsets":[0,0]}})"),
                  {"odd.safetensors", "nests deeper"});
  expect_contains(load_header(R"({"w":{"dtype":"F32","shape":[],"data_offsets":[0,4],"more":1}})"),
                  {"'w'", "nothing else"});
  std::string sizes = "[1";
  for (int i = 0; i < 1000000; ++i) sizes += ",1";
  const std::string e = load_header(R"({"w":{"dtype":"F32","shape":)" + sizes + R"(],"data_offsets":[0,4]}})");
  expect_contains(e, {"'w'", "1000001 dimensions"});
  EXPECT_LT(e.size(), 400u);
}

TEST_F(CheckpointTest, MismatchedModelOrOptimizerIsRefusedAndNothingIsLoaded) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  auto small = nn::make_mlp({.in_features = 6, .hidden = {5}, .num_classes = 3}, &gen);
  optim::AdamW small_opt(small->parameters());
  backward(sum(small->forward(randn({2, 6}, DType::f32, kCPU, &gen))));
  small_opt.step();
  const std::string path = file("m.safetensors");
  ckpt::save_checkpoint(path, ckpt::capture(*small, small_opt, 1, {}, gen));
  const ckpt::Checkpoint c = ckpt::read_checkpoint(path);

  // Another width: the model part does not fit.
  auto wide = nn::make_mlp({.in_features = 6, .hidden = {7}, .num_classes = 3}, &gen);
  optim::AdamW wide_opt(wide->parameters());
  Generator rng(99);
  const auto before = values_of(wide->state_dict());
  const std::string e = error_of<ValueError>([&] { ckpt::restore(c, *wide, wide_opt, rng, path); });
  expect_contains(e, {path, "model", "0.weight", "[5, 6]", "[7, 6]", "nothing was loaded"});
  EXPECT_EQ(values_of(wide->state_dict()), before);
  EXPECT_EQ(wide_opt.state_dict().size(), 2u);  // still only its group entries: no state came in
  EXPECT_EQ(rng.seed(), 99u);

  // Same model, other optimizer (SGD keeps no exp_avg): the model is put back.
  auto same = nn::make_mlp({.in_features = 6, .hidden = {5}, .num_classes = 3}, &gen);
  optim::SGD sgd(same->parameters(), {.lr = 0.1, .momentum = 0.9});
  const auto same_before = values_of(same->state_dict());
  const std::string e2 = error_of<ValueError>([&] { ckpt::restore(c, *same, sgd, rng, path); });
  expect_contains(e2, {"optimizer", "exp_avg", "nothing was loaded"});
  EXPECT_EQ(values_of(same->state_dict()), same_before);
}

TEST_F(CheckpointTest, CrashDuringSaveLeavesThePreviousCheckpoint) {
  Generator gen(5);
  auto mlp = nn::make_mlp({.in_features = 4, .hidden = {4}, .num_classes = 2}, &gen);
  optim::SGD opt(mlp->parameters(), {.lr = 0.1});
  const std::string path = file("keep.safetensors");
  ckpt::save_checkpoint(path, ckpt::capture(*mlp, opt, 1, {0, 1}, gen));
  const Bytes original = read_bytes(path);

  for (const Tensor& p : mlp->parameters()) prim::fill_(p, 42.0);
  std::string temp_seen;
  EXPECT_THROW(ckpt::save_checkpoint(path, ckpt::capture(*mlp, opt, 2, {0, 2}, gen),
                                     [&](const std::string& temp) {
                                       temp_seen = temp;
                                       EXPECT_TRUE(fs::exists(temp));
                                       throw IOError("simulated crash while writing");
                                     }),
               IOError);
  EXPECT_EQ(read_bytes(path), original);
  EXPECT_EQ(ckpt::read_checkpoint(path).step, 1);
  EXPECT_FALSE(temp_seen.empty());
  EXPECT_FALSE(fs::exists(temp_seen));  // cleaned up
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_.path()), fs::directory_iterator()), 1);
}

// JSON holds only UTF-8: a name or metadata string that is not (a Latin-1
// file name, say) is refused as bad input, naming it, and the previous
// file stays.
// Two threads saving to one path at once: each save has a temporary of its
// own, so every save succeeds and the file left is one of them, whole.
TEST_F(CheckpointTest, ConcurrentSavesToOnePathEachPublishAWholeFile) {
  const std::string path = file("shared.safetensors");
  auto save_versions = [&](float base) {
    for (int i = 0; i < 30; ++i) {
      const float v = base + static_cast<float>(i);
      io::save_safetensors(path, {{"w", full({4096}, v)}, {"v", full({1}, v)}});
    }
  };
  std::thread other(save_versions, 1000.0f);
  save_versions(0.0f);
  other.join();
  const io::TensorFile f = io::load_safetensors(path);
  const auto v = static_cast<float>(f.tensors.at("v").item());
  EXPECT_TRUE(v == 29.0f || v == 1029.0f) << v;  // the last save of either thread
  for (float w : f.tensors.at("w").to_vector<float>()) ASSERT_EQ(w, v);
  for (const auto& e : fs::directory_iterator(dir_.path()))
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
}

TEST_F(CheckpointTest, TextThatIsNotUtf8IsRefusedBeforeWriting) {
  const std::string path = file("text.safetensors");
  io::save_safetensors(path, {{"w", zeros({2})}}, {{"run.data", "data"}});
  const Bytes original = read_bytes(path);
  const std::string latin1 = "caf\xe9";
  const auto refused = [&](const OrderedDict<Tensor>& tensors, const io::Metadata& metadata, const char* what) {
    const std::string message = error_of<ValueError>([&] { io::save_safetensors(path, tensors, metadata); });
    expect_contains(message, {"save_safetensors", what, "not valid UTF-8", "caf"});
  };
  refused({{latin1, zeros({2})}}, {}, "tensor name");
  refused({{"w", zeros({2})}}, {{"run.data", latin1}}, "metadata value");
  refused({{"w", zeros({2})}}, {{latin1, "x"}}, "metadata key");
  EXPECT_EQ(read_bytes(path), original);
}

TEST_F(CheckpointTest, KilledWhileWritingLeavesAWholeCheckpoint) {
  // A child process writes a checkpoint of ~7.5 MB over and over, each
  // version with every parameter equal to its number; it is killed
  // (SIGKILL) at random moments, and every other time just after its
  // temporary file appeared. After each kill the file on disk must load
  // and be one whole version, and at most the killed writer's temporary may
  // be left (the next writer removes it).
  Generator gen(8);
  auto mlp = nn::make_mlp({.in_features = 784, .hidden = {1024, 1024}, .num_classes = 10}, &gen);
  optim::SGD opt(mlp->parameters(), {.lr = 0.1});
  const std::string path = file("big.safetensors");
  auto version = [&](int64_t v) {
    for (const Tensor& p : mlp->parameters()) prim::fill_(p, static_cast<double>(v));
    return ckpt::capture(*mlp, opt, v, {0, v}, gen);
  };
  ckpt::save_checkpoint(path, version(1));
  auto temporaries = [&] {
    int n = 0;
    for (const auto& e : fs::directory_iterator(dir_.path())) n += e.path().filename().string().find(".tmp.") != std::string::npos;
    return n;
  };

  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(fmt::format("kill times drawn with seed {}", seed));
  std::mt19937_64 rng(seed);
  const int kills = 25;
  int mid_write = 0, survived = 0;
  int64_t last = 1;
  for (int k = 0; k < kills; ++k) {
    const int64_t first = (k + 1) * 1000;  // this writer's versions: first, first + 1, ...
    const pid_t writer = ::fork();
    ASSERT_GE(writer, 0);
    if (writer == 0) {
      for (int64_t v = first;; ++v) ckpt::save_checkpoint(path, version(v));
    }
    if (k % 2 == 0) {
      // At a random moment.
      std::this_thread::sleep_for(std::chrono::milliseconds(20 + rng() % 200));
    } else {
      // Within a few milliseconds of the writer's temporary appearing: in
      // the middle of writing it (most of a save is spent before, building
      // the bytes and their checksum).
      char host[256] = {};
      ASSERT_EQ(::gethostname(host, sizeof(host) - 1), 0);
      // ".big.safetensors.tmp.<host>.<pid>.<which save>"
      const std::string writers = fmt::format(".big.safetensors.tmp.{}.{}.", host, writer);
      auto writing = [&] {
        for (const auto& e : fs::directory_iterator(dir_.path()))
          if (e.path().filename().string().rfind(writers, 0) == 0) return true;
        return false;
      };
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (!writing() && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 3000));
    }
    ::kill(writer, SIGKILL);
    int status = 0;
    ::waitpid(writer, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);

    const int left = temporaries();
    EXPECT_LE(left, 1) << "temporaries pile up after kill " << k;
    mid_write += left == 1;
    // The file is one whole version: the previous writer's last, or one of
    // this writer's.
    const ckpt::Checkpoint c = ckpt::read_checkpoint(path);
    const bool known = c.step == last || (c.step >= first && c.step < first + 1000);
    EXPECT_TRUE(known) << "step " << c.step << " after kill " << k;
    bool whole = known && c.position.batch == c.step;
    for (const auto& [name, t] : c.model)
      for (double x : t.to_vector<double>()) whole = whole && x == static_cast<double>(c.step);
    EXPECT_TRUE(whole) << "kill " << k << ": the checkpoint mixes versions";
    auto loaded = nn::make_mlp({.in_features = 784, .hidden = {1024, 1024}, .num_classes = 10}, &gen);
    optim::SGD loaded_opt(loaded->parameters(), {.lr = 0.1});
    Generator rng_state(0);
    ckpt::restore(c, *loaded, loaded_opt, rng_state, path);
    EXPECT_EQ(loaded->parameters().front().to_vector<double>()[0], static_cast<double>(c.step));
    survived += whole;
    last = c.step;
  }
  std::printf("faults injected: %d kills of a checkpoint writer (%d in the middle of a write), survived: %d\n", kills,
              mid_write, survived);
  EXPECT_EQ(survived, kills);
  EXPECT_GE(mid_write, kills / 3) << "too few kills landed in the middle of a write to test anything";
  // The next save removes the killed writer's temporary.
  ckpt::save_checkpoint(path, version(last + 1));
  EXPECT_EQ(temporaries(), 0);
}

TEST_F(CheckpointTest, AnotherModelsCheckpointIsRefusedWithNothingLoaded) {
  // An MLP's checkpoint offered to a GPT-like stack of other layers: the
  // names differ, and the message lists what is missing and unexpected.
  Generator gen(4);
  auto mlp = nn::make_mlp({.in_features = 6, .hidden = {5}, .num_classes = 3}, &gen);
  optim::AdamW mlp_opt(mlp->parameters());
  const std::string path = file("mlp.safetensors");
  ckpt::save_checkpoint(path, ckpt::capture(*mlp, mlp_opt, 1, {}, gen));
  const ckpt::Checkpoint c = ckpt::read_checkpoint(path);

  auto other = nn::make_mlp({.in_features = 6, .hidden = {5, 5}, .num_classes = 3}, &gen);  // one layer more
  optim::AdamW other_opt(other->parameters());
  const auto before = values_of(other->state_dict());
  Generator rng(7);
  const std::string e = error_of<ValueError>([&] { ckpt::restore(c, *other, other_opt, rng, path); });
  expect_contains(e, {path, "model", "4.weight", "nothing was loaded"});
  EXPECT_EQ(values_of(other->state_dict()), before);
  EXPECT_EQ(rng.seed(), 7u);
}

TEST_F(CheckpointTest, ARefusedFileLeavesTheModelAsItWas) {
  // The whole load path (read, then restore) on truncated and bit-flipped
  // files: the read refuses, so the live model never changes.
  Generator gen(6);
  auto saved = nn::make_mlp({.in_features = 6, .hidden = {5}, .num_classes = 3}, &gen);
  optim::AdamW saved_opt(saved->parameters());
  const std::string good_path = file("good.safetensors");
  ckpt::save_checkpoint(good_path, ckpt::capture(*saved, saved_opt, 9, {0, 9}, gen));
  const Bytes good = read_bytes(good_path);

  auto live = nn::make_mlp({.in_features = 6, .hidden = {5}, .num_classes = 3}, &gen);
  optim::AdamW live_opt(live->parameters());
  const auto before = values_of(live->state_dict());
  auto load = [&](const std::string& p) {
    Generator rng(1);
    ckpt::restore(ckpt::read_checkpoint(p), *live, live_opt, rng, p);
  };
  const std::string bad = file("bad.safetensors");
  int refused = 0;
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 40; ++trial) {
    Bytes b = good;
    if (trial % 2 == 0) b.resize(rng() % good.size());  // truncated anywhere
    else b[rng() % b.size()] ^= static_cast<uint8_t>(1u << (rng() % 8));  // one bit flipped anywhere
    write_bytes(bad, b);
    const std::string e = error_of<IOError>([&] { load(bad); });
    refused += e.find(bad) != std::string::npos;
    EXPECT_EQ(values_of(live->state_dict()), before) << "trial " << trial << ": " << e;
  }
  std::printf("damaged checkpoints refused, naming the file: %d of 40\n", refused);
  EXPECT_EQ(refused, 40);
  load(good_path);  // and the good one still loads
  EXPECT_EQ(values_of(live->state_dict()), values_of(saved->state_dict()));
}

// ---- continuing a run ----------------------------------------------------------------------------

TEST_F(CheckpointTest, RestoredRunContinuesBitIdentically) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  auto train = [](nn::Module& m, optim::Optimizer& opt, Generator& gen, int steps) {
    for (int i = 0; i < steps; ++i) {
      const Tensor x = randn({8, 6}, DType::f32, kCPU, &gen);
      opt.zero_grad();
      backward(mean(m.forward(x) * m.forward(x)));
      opt.step();
    }
  };
  Generator gen(seed);
  auto a = nn::make_mlp({.in_features = 6, .hidden = {16}, .num_classes = 3}, &gen);
  optim::AdamW opt_a(a->parameters(), {.lr = 1e-2});
  train(*a, opt_a, gen, 3);
  ckpt::Checkpoint c = ckpt::capture(*a, opt_a, 3, {0, 3}, gen);
  c.info["run.model"] = "mlp";
  c.extra.insert("scale", scalar_tensor(65536.0));
  ckpt::save_checkpoint(file("r.safetensors"), c);
  train(*a, opt_a, gen, 3);

  Generator other(seed + 1);
  auto b = nn::make_mlp({.in_features = 6, .hidden = {16}, .num_classes = 3}, &other);
  optim::AdamW opt_b(b->parameters(), {.lr = 1e-2});
  const ckpt::Checkpoint r = ckpt::read_checkpoint(file("r.safetensors"));
  EXPECT_EQ(r.step, 3);
  EXPECT_EQ(r.position.batch, 3);
  EXPECT_EQ(r.info.at("run.model"), "mlp");
  EXPECT_EQ(r.extra.at("scale").item(), 65536.0);
  ckpt::restore(r, *b, opt_b, other);
  train(*b, opt_b, other, 3);
  EXPECT_EQ(values_of(b->state_dict()), values_of(a->state_dict()));
  EXPECT_EQ(values_of(opt_b.state_dict()), values_of(opt_a.state_dict()));
}

}  // namespace
}  // namespace mpt
