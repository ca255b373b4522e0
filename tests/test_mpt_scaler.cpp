// mpt-scaler end to end: a replay through every policy writes one
// trajectory per policy that follows the written rules, and values no run
// could take are refused before any work as usage errors (status 2) that
// name the flag.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <zlib.h>

#include "amp/scaler_trace.h"
#include "tests/test_util.h"

#ifndef MPT_SCALER_PATH
#error "MPT_SCALER_PATH must name the mpt-scaler binary"
#endif

namespace mpt {
namespace {

std::string mpt_scaler() { return testing::build_file("../tools/mpt-scaler/mpt-scaler", MPT_SCALER_PATH); }

class MptScaler : public ::testing::Test {
 protected:
  std::string file(const std::string& name) const { return dir_.file(name); }
  // Runs mpt-scaler with `args` in the test's folder; returns its exit
  // status and keeps its standard error.
  int run(const std::string& args) {
    const std::string cmd = fmt::format("cd '{}' && '{}' {} >stdout 2>stderr", dir_.path().string(), mpt_scaler(), args);
    const int rc = std::system(cmd.c_str());
    std::ifstream in(file("stderr"));
    stderr_.assign(std::istreambuf_iterator<char>(in), {});
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  }

  testing::TempDir dir_{"mpt-scaler-test"};
  std::string stderr_;
};

TEST_F(MptScaler, AReplayThroughEveryPolicyFollowsTheWrittenRules) {
  ASSERT_EQ(run("replay --policy all --pattern bursts:37:2 --steps 300 --growth-interval 10 --out run.jsonl"), 0)
      << stderr_;
  const auto torch = amp::read_scaler_trace(file("run.torch.jsonl"));
  ASSERT_EQ(torch.size(), 300u);
  // PyTorch's rule: halve and restart the count on an overflow; double after
  // 10 clean steps in a row.
  double scale = 65536;
  int64_t clean = 0, overflows = 0;
  for (const auto& row : torch) {
    SCOPED_TRACE(row.step);
    ASSERT_EQ(row.scale, scale);
    overflows += row.found_inf;
    EXPECT_EQ(row.skipped, row.found_inf);
    if (row.found_inf) {
      scale *= 0.5;
      clean = 0;
    } else if (++clean == 10) {
      scale *= 2;
      clean = 0;
    }
    ASSERT_EQ(row.next_scale, scale);
    EXPECT_EQ(row.growth_tracker, clean);
  }
  EXPECT_GT(overflows, 10);
  // The static policy never moves; hysteresis backs off later than torch.
  for (const auto& row : amp::read_scaler_trace(file("run.static.jsonl"))) ASSERT_EQ(row.next_scale, 65536) << row.step;
  const auto hysteresis = amp::read_scaler_trace(file("run.hysteresis.jsonl"));
  ASSERT_EQ(hysteresis.size(), 300u);
  size_t first_torch_backoff = 0, first_hysteresis_backoff = 0;
  while (torch[first_torch_backoff].next_scale >= torch[first_torch_backoff].scale) ++first_torch_backoff;
  while (hysteresis[first_hysteresis_backoff].next_scale >= hysteresis[first_hysteresis_backoff].scale)
    ++first_hysteresis_backoff;
  EXPECT_GT(first_hysteresis_backoff, first_torch_backoff);
}

TEST_F(MptScaler, ValuesNoRunCouldTakeAreUsageErrorsNamingTheFlag) {
  const std::pair<const char*, const char*> cases[] = {
      {"replay --growth-interval 0", "--growth-interval must be >= 1"},
      {"replay --growth-factor 1", "--growth-factor must be > 1"},
      {"replay --backoff-factor 1.5", "--backoff-factor must be in (0, 1)"},
      {"replay --hysteresis 0", "--hysteresis must be >= 1"},
      {"replay --min-scale 8 --max-scale 4", "--min-scale 8 is above --max-scale 4"},
      {"replay --policy fastest", "--policy: fastest not in"},
      {"replay --policy all --policy torch", "--policy all stands alone"},
      {"replay --pattern sometimes", "overflow pattern 'sometimes' not understood"},
      {"replay --pattern periodic:10abc", "overflow pattern 'periodic:10abc' not understood"},
      {"replay --pattern bursts:10:3.7", "overflow pattern 'bursts:10:3.7' not understood"},
      {"replay --pattern bernoulli:0.5x", "overflow pattern 'bernoulli:0.5x' not understood"},
      {"replay --out scale.txt", "cannot tell the format of 'scale.txt'"},
      {"sweep --dtype f32", "--dtype: f32 not in"},
      {"sweep --growth-unit epochs", "--growth-unit: epochs not in"},
      {"sweep --intervals 50,0", "--intervals: must be positive, got 0"},
      {"sweep --device tpu", "unknown device 'tpu'"},
      {"plot run.jsonl --width 10", "--width: Value 10 not in range"},
      {"replay --steps 10000000000000", "--steps: Value 10000000000000 not in range"},
  };
  for (const auto& [args, message] : cases) {
    EXPECT_EQ(run(args), 2) << args << ": " << stderr_;
    EXPECT_NE(stderr_.find(message), std::string::npos) << args << ": " << stderr_;
    EXPECT_FALSE(std::filesystem::exists(file("scale.jsonl"))) << args;
  }
}

// Outputs replace the files they name only once the whole command
// succeeded: a plot that cannot be written fails the replay before any
// trajectory is written, the previous ones stay as they were, and no
// temporary is left behind.
TEST_F(MptScaler, AFailedReplayLeavesThePreviousOutputsWhole) {
  ASSERT_EQ(run("replay --policy all --pattern periodic:50 --steps 200 --out run.jsonl"), 0) << stderr_;
  const auto files_in_folder = [&] {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(dir_.path()))
      if (entry.path().filename() != "stdout" && entry.path().filename() != "stderr")
        names.push_back(entry.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  };
  const std::vector<std::string> before = files_in_folder();
  EXPECT_EQ(before, (std::vector<std::string>{"run.hysteresis.jsonl", "run.static.jsonl", "run.torch.jsonl"}));
  const auto torch = amp::read_scaler_trace(file("run.torch.jsonl"));

  EXPECT_EQ(run("replay --policy all --pattern periodic:7 --steps 300 --out run.jsonl --plot no/such/folder.png"), 1);
  EXPECT_NE(stderr_.find("no/such/folder.png"), std::string::npos) << stderr_;
  EXPECT_EQ(files_in_folder(), before);
  const auto after = amp::read_scaler_trace(file("run.torch.jsonl"));
  ASSERT_EQ(after.size(), torch.size());
  for (size_t i = 0; i < after.size(); ++i) ASSERT_EQ(after[i].next_scale, torch[i].next_scale) << i;

  ASSERT_EQ(run("replay --policy torch --steps 100 --out run.torch.jsonl --plot run.png"), 0) << stderr_;
  EXPECT_EQ(files_in_folder(),
            (std::vector<std::string>{"run.hysteresis.jsonl", "run.png", "run.static.jsonl", "run.torch.jsonl"}));
  EXPECT_EQ(amp::read_scaler_trace(file("run.torch.jsonl")).size(), 100u);
}

// The pixels of a PNG as mpt-scaler writes it (8-bit RGB, every scanline
// unfiltered), row by row.
struct RgbImage {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;
  int count(uint8_t r, uint8_t g, uint8_t b) const {
    int n = 0;
    for (size_t i = 0; i + 2 < rgb.size(); i += 3) n += rgb[i] == r && rgb[i + 1] == g && rgb[i + 2] == b;
    return n;
  }
};

RgbImage read_png(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), {});
  auto u32 = [&](size_t at) {
    return uint32_t{static_cast<uint8_t>(bytes.at(at))} << 24 | uint32_t{static_cast<uint8_t>(bytes.at(at + 1))} << 16 |
           uint32_t{static_cast<uint8_t>(bytes.at(at + 2))} << 8 | uint32_t{static_cast<uint8_t>(bytes.at(at + 3))};
  };
  RgbImage img;
  std::string packed;
  for (size_t at = 8; at + 8 <= bytes.size();) {  // after the 8-byte signature: length, type, data, CRC
    const uint32_t length = u32(at);
    const std::string type = bytes.substr(at + 4, 4);
    if (type == "IHDR") {
      img.width = static_cast<int>(u32(at + 8));
      img.height = static_cast<int>(u32(at + 12));
    }
    if (type == "IDAT") packed += bytes.substr(at + 8, length);
    at += 12 + length;
  }
  const size_t row = 1 + 3 * static_cast<size_t>(img.width);
  std::vector<uint8_t> raw(row * static_cast<size_t>(img.height));
  uLongf raw_size = raw.size();
  EXPECT_EQ(uncompress(raw.data(), &raw_size, reinterpret_cast<const Bytef*>(packed.data()), packed.size()), Z_OK);
  for (int y = 0; y < img.height; ++y) {
    EXPECT_EQ(raw[y * row], 0) << "scanline " << y << " is filtered";
    img.rgb.insert(img.rgb.end(), raw.begin() + static_cast<std::ptrdiff_t>(y * row + 1),
                   raw.begin() + static_cast<std::ptrdiff_t>((y + 1) * row));
  }
  return img;
}

// Each step's scale is held up to the next step, the last one's too: a
// trace of one step draws a line across the plot, not only the legend's
// swatch.
TEST_F(MptScaler, PlotDrawsEveryStepToItsNextScale) {
  ASSERT_EQ(run("replay --policy torch --steps 1 --out one.jsonl --plot one.png"), 0) << stderr_;
  const RgbImage one = read_png(file("one.png"));
  ASSERT_EQ(one.width, 1000);
  const int swatch = 14 * 10;  // the legend's, at most
  // The series' colour (the palette's first) along the plot's whole width, 2 pixels thick.
  EXPECT_GT(one.count(31, 119, 180), swatch + 2 * 800) << "a one-step trace drew no line";
}

}  // namespace
}  // namespace mpt
