// mpt-bench end to end: without a GPU it says it skipped (status 77, apart
// from a usage error's 2); on a GPU every workload prints one JSON line in
// torch_bench.py's form whose figures hang together, with its step replayed
// as a CUDA graph, and the loss it reports is a training loss that fell.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tensor/device.h"
#include "tests/test_util.h"

#ifndef MPT_BENCH_PATH
#error "MPT_BENCH_PATH must name the mpt-bench binary"
#endif

namespace mpt {
namespace {

std::string mpt_bench() { return testing::build_file("../tools/mpt-bench/mpt-bench", MPT_BENCH_PATH); }

class MptBench : public ::testing::Test {
 protected:
  // Runs mpt-bench with `args`; returns its exit status, keeps its output.
  int run(const std::string& args) {
    const std::string cmd = fmt::format("'{}' {} >'{}' 2>'{}'", mpt_bench(), args, dir_.file("stdout"),
                                        dir_.file("stderr"));
    const int rc = std::system(cmd.c_str());
    stdout_ = slurp(dir_.file("stdout"));
    stderr_ = slurp(dir_.file("stderr"));
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  }
  static std::string slurp(const std::string& path) {
    std::ifstream in(path);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  }

  testing::TempDir dir_{"mpt-bench-test"};
  std::string stdout_, stderr_;
};

TEST_F(MptBench, AWrongCommandLineIsAUsageError) {
  EXPECT_EQ(run("--steps 0"), 2) << stderr_;
  EXPECT_NE(stderr_.find("--steps"), std::string::npos) << stderr_;
  EXPECT_EQ(run("--workload resnet"), 2) << stderr_;
  EXPECT_EQ(run("--mode allreduce --ways nccl carrier-pigeon"), 2) << stderr_;
  EXPECT_NE(stderr_.find("carrier-pigeon"), std::string::npos) << stderr_;
  EXPECT_EQ(run("--mode allreduce --sizes-kib 0"), 2) << stderr_;
}

TEST_F(MptBench, WithoutAGpuItSaysItSkipped) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "skipped: this machine has a CUDA device";
  EXPECT_EQ(run("--workload mlp_small"), 77) << stderr_;
  EXPECT_NE(stderr_.find("skipped: no CUDA device"), std::string::npos) << stderr_;
}

TEST_F(MptBench, EveryWorkloadPrintsOneConsistentJsonLine) {
  MPT_SKIP_WITHOUT_CUDA();
  for (const std::string workload : {"mlp_small", "cnn", "cnn_bn", "gpt_mini", "mlp_large", "gpt2_124m"}) {
    SCOPED_TRACE(workload);
    ASSERT_EQ(run(fmt::format("--workload {} --warmup 3 --steps 10", workload)), 0) << stderr_;
    const nlohmann::json j = nlohmann::json::parse(stdout_.substr(0, stdout_.find('\n')));
    EXPECT_EQ(j["workload"], workload);
    EXPECT_EQ(j["mode"], "single");
    EXPECT_EQ(j["precision"], "fp16");
    EXPECT_EQ(j["impl"], "mptrain");
    EXPECT_TRUE(j["cuda_graph"].get<bool>());
    const double lo = j["step_ms_min"], median = j["step_ms_median"], hi = j["step_ms_max"];
    EXPECT_GT(lo, 0.0);
    EXPECT_LE(lo, median);
    EXPECT_LE(median, hi);
    // samples/s is the batch over the median step.
    EXPECT_NEAR(j["samples_per_s"].get<double>(), j["batch"].get<double>() / (median / 1000.0),
                1e-3 * j["samples_per_s"].get<double>());
    EXPECT_GT(j["peak_mem_mb"].get<double>(), 0.0);
    EXPECT_TRUE(std::isfinite(j["loss"].get<double>()));
    if (workload.starts_with("gpt")) {
      // Tokens/s is the batch's tokens over the median step; MFU the model's
      // FLOPs over the GEMM rate measured in the run, a fraction.
      const double tokens = j["batch"].get<double>() * (workload == "gpt_mini" ? 256 : 1024);
      const double tokens_per_s = tokens / (median / 1000.0);
      EXPECT_NEAR(j["tokens_per_s"].get<double>(), tokens_per_s, 1e-3 * tokens_per_s);
      EXPECT_GT(j["gemm_ceiling_tflops"].get<double>(), 0.0);
      EXPECT_NEAR(j["mfu"].get<double>(), j["model_tflops"].get<double>() / j["gemm_ceiling_tflops"].get<double>(), 1e-3);
      EXPECT_GT(j["mfu"].get<double>(), 0.0);
      EXPECT_LT(j["mfu"].get<double>(), 1.0);
      // GPT-2 small's 1024 positions on cuDNN's fused attention, unless this
      // build lacks cudnn-frontend; gpt_mini's 256 on the own kernels.
      for (const char* pass : {"attention_forward", "attention_backward"}) {
        const std::string kernel = j[pass];
        if (workload == "gpt_mini")
          EXPECT_TRUE(kernel.starts_with("own (sequences of at most 256 positions") ||
                      kernel.starts_with("own (this build has no cudnn-frontend"))
              << kernel;
        else
          EXPECT_TRUE(kernel == "cudnn" || kernel.starts_with("own (this build has no cudnn-frontend")) << kernel;
      }
    }
  }
}

// --mode allreduce: one JSON line per way and size, every one replayed as
// a CUDA graph (one GPU: a world of one, whose kernels still run), with a
// positive time.
TEST_F(MptBench, TheAllReduceSweepPrintsALinePerWayAndSize) {
  MPT_SKIP_WITHOUT_CUDA();
  ASSERT_EQ(run("--mode allreduce --sizes-kib 64 1024 --warmup 1 --steps 3 --per-replay 2"), 0) << stderr_;
  std::vector<nlohmann::json> lines;
  size_t at = 0;
  for (size_t nl; (nl = stdout_.find('\n', at)) != std::string::npos; at = nl + 1)
    lines.push_back(nlohmann::json::parse(stdout_.substr(at, nl - at)));
  ASSERT_EQ(lines.size(), 6u) << stdout_;
  size_t k = 0;
  for (const char* way : {"nccl", "symmetric", "peer"})
    for (int64_t bytes : {64 * 1024, 1024 * 1024}) {
      const nlohmann::json& j = lines[k++];
      EXPECT_EQ(j["mode"], "allreduce");
      EXPECT_EQ(j["way"], way);
      EXPECT_EQ(j["bytes"].get<int64_t>(), bytes);
      EXPECT_EQ(j["gpus"].get<int>(), cuda_device_count());
      EXPECT_GT(j["us_median"].get<double>(), 0.0);
      EXPECT_TRUE(j["cuda_graph"].get<bool>()) << j.dump();
    }
}

// The loss mpt-bench prints is the training loss after its steps: more
// steps on the same data bring it lower.
TEST_F(MptBench, MoreStepsEndAtALowerLoss) {
  MPT_SKIP_WITHOUT_CUDA();
  const auto loss_after = [&](int steps) {
    EXPECT_EQ(run(fmt::format("--workload mlp_small --warmup 0 --steps {}", steps)), 0) << stderr_;
    return nlohmann::json::parse(stdout_.substr(0, stdout_.find('\n')))["loss"].get<double>();
  };
  const double early = loss_after(2), late = loss_after(200);
  EXPECT_LT(late, 0.5 * early) << early << " -> " << late;
}

}  // namespace
}  // namespace mpt
