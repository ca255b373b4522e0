// mpt-scaler end to end: a replay through every policy writes one
// trajectory per policy that follows the written rules, rows that name
// their policy; a sweep trains on its --data and keeps its configuration
// and trajectories; plots are gnuplot scripts with names, axes and
// settings, drawn where gnuplot is installed and explained where it is not;
// values no run could take are refused before any work as usage errors
// (status 2) that name the flag.
#include <gtest/gtest.h>

#include <cmath>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "amp/scaler_trace.h"
#include "tests/test_util.h"

#ifndef MPT_SCALER_PATH
#error "MPT_SCALER_PATH must name the mpt-scaler binary"
#endif

namespace mpt {
namespace {

std::string mpt_scaler() { return testing::build_file("../tools/mpt-scaler/mpt-scaler", MPT_SCALER_PATH); }

bool have_gnuplot() { return std::system("command -v gnuplot >/dev/null 2>&1") == 0; }

class MptScaler : public ::testing::Test {
 protected:
  std::string file(const std::string& name) const { return dir_.file(name); }
  std::string read(const std::string& name) const {
    std::ifstream in(file(name), std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  // Runs mpt-scaler with `args` in the test's folder (with `env`, such as
  // "PATH=/nowhere", set for it); returns its exit status and keeps its
  // standard error.
  int run(const std::string& args, const std::string& env = "") {
    const std::string cmd =
        fmt::format("cd '{}' && {} '{}' {} >stdout 2>stderr", dir_.path().string(), env, mpt_scaler(), args);
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
      {"replay --plot scale.gp", "--plot must name a .png file, got 'scale.gp'"},
      {"plot scale.jsonl --out scale.svg", "--out must name a .png file, got 'scale.svg'"},
      {"sweep --dtype f32", "--dtype: f32 not in"},
      {"sweep --growth-unit epochs", "--growth-unit: epochs not in"},
      {"sweep --intervals 50,0", "--intervals: must be positive, got 0"},
      {"sweep --device tpu", "unknown device 'tpu'"},
      {"sweep --model gpt --data no-such.txt", "--model gpt trains on a text file or 'fortunes'; --data 'no-such.txt'"},
      {"sweep --model mlp --data fortunes", "--model mlp trains on 'fashion-mnist' or a folder"},
      {"plot run.jsonl --width 10", "--width: Value 10 not in range"},
      {"replay --steps 10000000000000", "--steps: Value 10000000000000 not in range"},
      {"fp8 --batch 10", "--batch 10 is not a multiple of 16"},
      {"fp8 --recipe late", "--recipe: late not in"},
      {"fp8 --histories 4,0", "--histories: must be positive, got 0"},
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

  // A plot adds its script beside the PNG; without gnuplot the status is 1,
  // the data and the script are written and the PNG is not.
  const int status = run("replay --policy torch --steps 100 --out run.torch.jsonl --plot run.png");
  std::vector<std::string> expected = {"run.gp", "run.hysteresis.jsonl", "run.png", "run.static.jsonl",
                                       "run.torch.jsonl"};
  if (!have_gnuplot()) {
    EXPECT_EQ(status, 1) << stderr_;
    expected.erase(expected.begin() + 2);
  } else {
    EXPECT_EQ(status, 0) << stderr_;
  }
  EXPECT_EQ(files_in_folder(), expected);
  EXPECT_EQ(amp::read_scaler_trace(file("run.torch.jsonl")).size(), 100u);
}

// Each row of a trajectory says its policy and leaves out what does not
// apply: hysteresis_left outside the hysteresis policy, a gradient norm
// and gradient name that a replay never measures. CSV rows leave the
// cells empty under the same header.
TEST_F(MptScaler, TrajectoryRowsNameTheirPolicyAndLeaveOutWhatDoesNotApply) {
  ASSERT_EQ(run("replay --policy all --pattern periodic:5 --steps 20 --out run.jsonl"), 0) << stderr_;
  for (const std::string policy : {"torch", "hysteresis", "static"}) {
    SCOPED_TRACE(policy);
    std::ifstream in(file("run." + policy + ".jsonl"));
    int rows = 0;
    for (std::string line; std::getline(in, line); ++rows) {
      const auto row = nlohmann::json::parse(line);
      EXPECT_EQ(row.at("policy"), policy) << line;
      EXPECT_EQ(row.contains("hysteresis_left"), policy == "hysteresis") << line;
      EXPECT_FALSE(row.contains("grad_norm")) << line;
      EXPECT_FALSE(row.contains("first_nonfinite")) << line;
      for (const char* key : {"step", "scale", "next_scale", "growth_tracker", "found_inf", "skipped"})
        EXPECT_TRUE(row.contains(key)) << key << ": " << line;
    }
    EXPECT_EQ(rows, 20);
  }
  ASSERT_EQ(run("replay --policy torch --pattern periodic:5 --steps 5 --out run.csv"), 0) << stderr_;
  EXPECT_EQ(read("run.csv"),
            "step,policy,scale,next_scale,growth_tracker,hysteresis_left,found_inf,skipped,first_nonfinite,grad_norm\n"
            "0,torch,65536,65536,1,,0,0,,\n"
            "1,torch,65536,65536,2,,0,0,,\n"
            "2,torch,65536,65536,3,,0,0,,\n"
            "3,torch,65536,65536,4,,0,0,,\n"
            "4,torch,65536,32768,0,,1,1,,\n");
  const auto rows = amp::read_scaler_trace(file("run.csv"));
  ASSERT_EQ(rows.size(), 5u);
  EXPECT_EQ(rows[4].policy, amp::ScalePolicy::torch);
  EXPECT_EQ(rows[4].grad_norm, -1);  // not measured
  ASSERT_EQ(run("replay --policy hysteresis --pattern periodic:5 --steps 5 --out run.csv"), 0) << stderr_;
  EXPECT_NE(read("run.csv").find("\n4,hysteresis,65536,65536,0,1,1,1,,\n"), std::string::npos) << read("run.csv");
}

// A PNG (its signature) of width x height (its IHDR chunk) with more in it
// than an empty frame.
void expect_png(const std::string& bytes, uint32_t width, uint32_t height) {
  ASSERT_GT(bytes.size(), 24u);
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  EXPECT_EQ(bytes.substr(12, 4), "IHDR");
  auto u32 = [&](size_t at) {
    uint32_t v = 0;
    for (size_t i = 0; i < 4; ++i) v = v << 8 | static_cast<uint8_t>(bytes[at + i]);
    return v;
  };
  EXPECT_EQ(u32(16), width);
  EXPECT_EQ(u32(20), height);
  EXPECT_GT(bytes.size(), 10000u) << "a plot of lines, text and a legend compresses to more than this";
}

// The script names every series in the legend, labels both axes, puts the
// settings in the title and marks the skipped steps; a one-step trace still
// draws its step, to the step after it.
TEST_F(MptScaler, ThePlotScriptNamesSeriesAxesAndSettings) {
  // Without gnuplot, so the script is there whether or not this machine has it.
  EXPECT_EQ(run("replay --policy all --pattern periodic:50 --steps 120 --growth-interval 10 --out run.jsonl "
                "--plot run.png",
                "PATH=/nowhere"),
            1)
      << stderr_;
  const std::string script = read("run.gp");
  for (const char* text : {
           "title \"torch\" noenhanced",
           "title \"hysteresis\" noenhanced",
           "title \"static\" noenhanced",
           "title \"skipped step (overflow)\"",
           "set xlabel \"step\"",
           "set ylabel \"loss scale (log2)\"",
           "set logscale y 2",
           "set terminal pngcairo size 1000,500",
           "if (!exists(\"output\")) output = \"run.png\"",
           "set title \"mpt-scaler replay: pattern periodic:50, 120 steps\\npolicies torch, hysteresis, static; init "
           "scale 65536, growth factor 2, backoff factor 0.5, hysteresis 2, growth interval 10\" noenhanced",
           // Steps 49 and 99 overflow: each series marks them at the scale it skipped them at
           // (torch: 2^16 grown 4 times, halved, grown 4 times again).
           "$skipped1 << EOD\n49 1048576\n99 8388608\nEOD",
           "$skipped3 << EOD\n49 65536\n99 65536\nEOD",
       })
    EXPECT_NE(script.find(text), std::string::npos) << text << "\n" << script;

  ASSERT_EQ(run("replay --policy static --steps 1 --out one.jsonl --plot one.png", "PATH=/nowhere"), 1);
  const std::string one = read("one.gp");
  EXPECT_NE(one.find("$scale1 << EOD\n0 65536\n1 65536\nEOD"), std::string::npos) << one;
  EXPECT_EQ(one.find("$skipped"), std::string::npos) << one;
  EXPECT_EQ(one.find("skipped step (overflow)"), std::string::npos) << "no skipped steps, no legend entry\n" << one;
}

// Without gnuplot the data is written, the script beside where the PNG
// would be, and the message says what to install and where the data is;
// the script then draws the PNG as the message says.
TEST_F(MptScaler, WithoutGnuplotTheDataIsWrittenAndTheMessageSaysWhatToInstall) {
  EXPECT_EQ(run("replay --policy all --pattern periodic:50 --steps 200 --out run.jsonl --plot run.png",
                "PATH=/nowhere"),
            1);
  EXPECT_NE(stderr_.find("mpt-scaler: plotting needs gnuplot (apt install gnuplot-nox), which is not on PATH: run.png "
                         "was not drawn. The data is in run.torch.jsonl, run.hysteresis.jsonl, run.static.jsonl; "
                         "`gnuplot run.gp` draws run.png once gnuplot is installed"),
            std::string::npos)
      << stderr_;
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir_.path()))
    names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"run.gp", "run.hysteresis.jsonl", "run.static.jsonl", "run.torch.jsonl",
                                              "stderr", "stdout"}));
  EXPECT_EQ(amp::read_scaler_trace(file("run.torch.jsonl")).size(), 200u);

  if (!have_gnuplot()) GTEST_SKIP() << "gnuplot is not installed: the script was not run";
  ASSERT_EQ(std::system(fmt::format("cd '{}' && gnuplot run.gp", dir_.path().string()).c_str()), 0);
  expect_png(read("run.png"), 1000, 500);
}

TEST_F(MptScaler, WithGnuplotThePlotsAreRealPngs) {
  if (!have_gnuplot()) GTEST_SKIP() << "gnuplot is not installed (apt install gnuplot-nox)";
  ASSERT_EQ(run("replay --policy all --pattern bursts:100:3 --steps 1000 --growth-interval 20 --out run.csv "
                "--plot run.png"),
            0)
      << stderr_;
  expect_png(read("run.png"), 1000, 500);
  // `plot` draws traces at the size asked for, each named by its file.
  ASSERT_EQ(run("plot run.torch.csv run.static.csv --out both.png --width 640 --height 300"), 0) << stderr_;
  expect_png(read("both.png"), 640, 300);
  const std::string script = read("both.gp");
  EXPECT_NE(script.find("title \"run.torch.csv\" noenhanced"), std::string::npos) << script;
  EXPECT_NE(script.find("set title \"mpt-scaler plot: run.torch.csv, run.static.csv\""), std::string::npos) << script;
  // No temporaries are left behind.
  for (const auto& entry : std::filesystem::directory_iterator(dir_.path()))
    EXPECT_EQ(entry.path().filename().string().find("partial"), std::string::npos) << entry.path();
}

// A sweep trains on --data (here a text file for gpt) and its JSON holds
// every option, the workload trained and each interval's trajectory; its
// plot names each interval.
TEST_F(MptScaler, ASweepTrainsOnItsDataAndItsJsonHoldsConfigAndTrajectories) {
  {
    std::ofstream text(file("notes.txt"));
    for (int i = 0; i < 40; ++i) text << "the scale doubles after clean steps and halves on an overflow.\n";
  }
  const int status = run("sweep --model gpt --data notes.txt --steps 3 --batch 4 --intervals 1,2 --seed 7 "
                         "--out sweep.json --plot sweep.png");
  ASSERT_EQ(status, have_gnuplot() ? 0 : 1) << stderr_;
  const auto doc = nlohmann::json::parse(read("sweep.json"));
  const auto& config = doc.at("config");
  EXPECT_EQ(config.at("model"), "gpt");
  EXPECT_EQ(config.at("data"), "notes.txt");
  EXPECT_EQ(config.at("steps"), 3);
  EXPECT_EQ(config.at("batch"), 4);
  EXPECT_EQ(config.at("seed"), 7);
  EXPECT_EQ(config.at("device"), "cpu");
  EXPECT_EQ(config.at("dtype"), "f16");
  EXPECT_EQ(config.at("policy"), "torch");
  EXPECT_EQ(config.at("growth_unit"), "steps");
  EXPECT_EQ(config.at("intervals"), nlohmann::json::array({1, 2}));
  EXPECT_EQ(config.at("init_scale"), 65536);
  EXPECT_EQ(config.at("growth_factor"), 2);
  EXPECT_EQ(config.at("backoff_factor"), 0.5);
  EXPECT_EQ(config.at("hysteresis"), 2);
  EXPECT_EQ(config.at("consecutive_hysteresis"), false);
  EXPECT_TRUE(config.at("min_scale").is_null());
  EXPECT_TRUE(config.at("max_scale").is_null());
  // The workload is the one the data made: the text file, not the default corpus.
  EXPECT_NE(doc.at("workload").get<std::string>().find("'notes.txt'"), std::string::npos) << doc.at("workload");
  const auto& runs = doc.at("runs");
  ASSERT_EQ(runs.size(), 2u);
  for (size_t i = 0; i < runs.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(runs[i].at("growth_interval"), i + 1);
    const auto& trajectory = runs[i].at("trajectory");
    ASSERT_EQ(trajectory.size(), 3u);
    for (size_t step = 0; step < 3; ++step) {
      const auto& row = trajectory[step];
      EXPECT_EQ(row.at("step"), step);
      EXPECT_EQ(row.at("policy"), "torch");
      EXPECT_FALSE(row.contains("hysteresis_left")) << row;
      EXPECT_TRUE(row.contains("grad_norm")) << "a training measures its gradients: " << row;
    }
  }
  const std::string script = read("sweep.gp");
  for (const char* text : {"title \"growth_interval 1\" noenhanced", "title \"growth_interval 2\" noenhanced",
                           "set title \"mpt-scaler sweep: gpt on notes.txt, 3 steps, batch 4, lr 0.001, seed 7, f16 "
                           "autocast on cpu\\npolicy torch; init scale 65536, growth factor 2, backoff factor 0.5, "
                           "growth intervals 1, 2 (steps)\" noenhanced"})
    EXPECT_NE(script.find(text), std::string::npos) << text << "\n" << script;
  if (have_gnuplot()) expect_png(read("sweep.png"), 1000, 500);
}

// The FP8 lab: a run per history length, every FP8 tensor traced step by
// step, and delayed scaling's rule visible in the traces (with a history
// of 1, each step's scale is the format's maximum over the previous
// step's amax).
TEST_F(MptScaler, AnFp8SweepTracesEveryFp8TensorStepByStep) {
  {
    std::ofstream text(file("notes.txt"));
    for (int i = 0; i < 40; ++i) text << "each tensor gets its own scale from the amaxes it had before.\n";
  }
  const int status = run("fp8 --model gpt --data notes.txt --steps 3 --batch 16 --histories 1,2 --margins 0 "
                         "--seed 7 --out fp8.json --plot fp8.png");
  ASSERT_EQ(status, have_gnuplot() ? 0 : 1) << stderr_;
  const auto doc = nlohmann::json::parse(read("fp8.json"));
  const auto& config = doc.at("config");
  EXPECT_EQ(config.at("model"), "gpt");
  EXPECT_EQ(config.at("recipe"), "delayed");
  EXPECT_EQ(config.at("histories"), nlohmann::json::array({1, 2}));
  const auto& runs = doc.at("runs");
  ASSERT_EQ(runs.size(), 2u);
  for (size_t i = 0; i < runs.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(runs[i].at("history_length"), i + 1);
    EXPECT_TRUE(std::isfinite(runs[i].at("final_loss").get<double>()));
    const auto& tensors = runs[i].at("tensors");
    // Two blocks of four linear layers (the head stays in bf16), three
    // tensors each.
    ASSERT_EQ(tensors.size(), 24u);
    for (const auto& t : tensors) {
      SCOPED_TRACE(t.at("name").get<std::string>());
      const std::string name = t.at("name");
      EXPECT_TRUE(name.ends_with(".input") || name.ends_with(".weight") || name.ends_with(".grad_output"));
      ASSERT_EQ(t.at("scale").size(), 3u);
      for (size_t step = 0; step < 3; ++step) {
        EXPECT_GT(t.at("amax")[step].get<double>(), 0.0);
        EXPECT_GT(t.at("scale")[step].get<double>(), 0.0);
        for (const char* fraction : {"saturated", "flushed"}) {
          EXPECT_GE(t.at(fraction)[step].get<double>(), 0.0);
          EXPECT_LE(t.at(fraction)[step].get<double>(), 1.0);
        }
      }
      EXPECT_EQ(t.at("scale")[0], 1.0) << "no history yet";
      if (i == 0) {
        const float target = name.ends_with(".grad_output") ? 57344.0f : 448.0f;
        EXPECT_EQ(static_cast<float>(t.at("scale")[1].get<double>()),
                  target / static_cast<float>(t.at("amax")[0].get<double>()));
      }
    }
  }
  const std::string script = read("fp8.gp");
  for (const char* text : {"title \"history 1, margin 0\" noenhanced", "title \"history 2, margin 0\" noenhanced",
                           "FP8 scale (log2)", "the scale of blocks.0.qkv.grad_output"})
    EXPECT_NE(script.find(text), std::string::npos) << text << "\n" << script;
}

}  // namespace
}  // namespace mpt
