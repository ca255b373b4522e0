// mpt-parity end to end, on the CPU: it trains from the files it is given
// exactly as the library does in-process (the same losses, scales and final
// weights), and refuses files it cannot use with a message naming them.
// Against PyTorch it runs on the GPU machine (scripts/parity_vs_torch.py).
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "autograd/engine.h"
#include "autograd/ops.h"
#include "models/adamw.h"
#include "models/mlp.h"
#include "models/safetensors.h"
#include "tensor/ops.h"
#include "tests/test_util.h"

#ifndef MPT_PARITY_PATH
#error "MPT_PARITY_PATH must name the mpt-parity binary"
#endif

namespace mpt {
namespace {

constexpr int64_t kSteps = 16, kBatch = 6, kIn = 5, kClasses = 3;
constexpr double kLr = 1e-2, kInitScale = 1048576.0;  // 2^20: the first steps overflow in f16
constexpr int64_t kGrowthInterval = 2;

nn::MLPOptions mlp_options() { return {.in_features = kIn, .hidden = {7}, .num_classes = kClasses}; }

struct StepRecord {
  double loss, scale;
};

class MptParity : public ::testing::Test {
 protected:
  void SetUp() override {
    Generator gen(11);
    init_ = nn::make_mlp(mlp_options(), &gen)->state_dict();
    io::save_safetensors(dir_.file("init.safetensors"), init_);
    x_ = mul(randn({kSteps, kBatch, kIn}, DType::f32, kCPU, &gen), 3.0);
    std::vector<int64_t> labels;
    for (int64_t i = 0; i < kSteps * kBatch; ++i) labels.push_back((i * 7 + 3) % kClasses);
    y_ = from_vector(labels, {kSteps, kBatch}, DType::i64);
    io::save_safetensors(dir_.file("data.safetensors"), OrderedDict<Tensor>{{"x", x_}, {"y", y_}});
  }

  // Runs mpt-parity on the CPU; returns its exit status and keeps what it printed.
  int run(const std::string& args) {
    const std::string cmd = fmt::format(
        "'{}' --device cpu --init '{}' --out '{}' --lr {} --init-scale {} --growth-interval {} {} >'{}' 2>'{}'",
        testing::build_file("../tools/mpt-parity/mpt-parity", MPT_PARITY_PATH), dir_.file("init.safetensors"),
        dir_.file("final.safetensors"), kLr, kInitScale, kGrowthInterval, args, dir_.file("stdout"),
        dir_.file("stderr"));
    const int rc = std::system(cmd.c_str());
    stderr_ = slurp(dir_.file("stderr"));
    records_.clear();
    std::istringstream lines(slurp(dir_.file("stdout")));
    for (std::string line; std::getline(lines, line);) {
      const nlohmann::json j = nlohmann::json::parse(line);
      EXPECT_EQ(j["step"].get<int64_t>(), static_cast<int64_t>(records_.size()));
      records_.push_back({j["loss"].get<double>(), j["scale"].get<double>()});
    }
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  }

  // The same training in this process, written out with the library's API.
  std::vector<StepRecord> train_here(const std::string& precision, nn::StateDict& final_weights) {
    auto model = nn::make_mlp(mlp_options());
    model->load_state_dict(init_);
    optim::AdamW optimizer(model->parameters(), {.lr = kLr});
    amp::GradScaler scaler({.init_scale = kInitScale, .growth_interval = kGrowthInterval,
                            .enabled = precision == "fp16"});
    std::vector<StepRecord> records;
    for (int64_t s = 0; s < kSteps; ++s) {
      const Tensor x = squeeze(slice(x_, 0, s, s + 1), 0), y = squeeze(slice(y_, 0, s, s + 1), 0);
      optimizer.zero_grad();
      Tensor loss;
      {
        amp::AutocastGuard autocast(DeviceType::cpu, precision == "bf16" ? DType::bf16 : DType::f16,
                                    precision != "fp32");
        loss = cross_entropy(model->forward(x), y);
      }
      backward(scaler.scale(loss));
      scaler.step(optimizer);
      scaler.update();
      records.push_back({loss.item(), scaler.get_scale()});
    }
    final_weights = model->state_dict();
    return records;
  }

  static std::string slurp(const std::string& path) {
    std::ifstream in(path);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  }

  testing::TempDir dir_{"mpt-parity-test"};
  nn::StateDict init_;
  Tensor x_, y_;
  std::string stderr_;
  std::vector<StepRecord> records_;
};

TEST_F(MptParity, TrainsAsTheLibraryDoesInProcess) {
  for (const std::string precision : {"fp32", "bf16", "fp16"}) {
    SCOPED_TRACE(precision);
    ASSERT_EQ(run(fmt::format("--model mlp --data '{}' --precision {}", dir_.file("data.safetensors"), precision)), 0)
        << stderr_;
    nn::StateDict expected_weights;
    const std::vector<StepRecord> expected = train_here(precision, expected_weights);
    ASSERT_EQ(records_.size(), expected.size());
    for (size_t s = 0; s < expected.size(); ++s) {
      SCOPED_TRACE(s);
      EXPECT_NEAR(records_[s].loss, expected[s].loss, 1e-7 * std::abs(expected[s].loss));
      EXPECT_EQ(records_[s].scale, expected[s].scale);
    }
    const io::TensorFile written = io::load_safetensors(dir_.file("final.safetensors"));
    ASSERT_EQ(written.tensors.keys(), expected_weights.keys());
    for (const std::string& name : expected_weights.keys())
      EXPECT_EQ(written.tensors.at(name).to_vector<float>(), expected_weights.at(name).to_vector<float>()) << name;
  }
  // In f16 the run went through the scaler's whole rule: backed off from
  // 2^24 (skipping those steps), then grew after clean steps.
  bool backed_off = false, grew = false;
  for (size_t s = 1; s < records_.size(); ++s) {
    backed_off |= records_[s].scale < records_[s - 1].scale;
    grew |= records_[s].scale > records_[s - 1].scale;
  }
  EXPECT_LT(records_.front().scale, kInitScale);
  EXPECT_TRUE(backed_off && grew) << "scales from " << records_.front().scale << " to " << records_.back().scale;
}

TEST_F(MptParity, RefusesDataItCannotUse) {
  io::save_safetensors(dir_.file("no-labels.safetensors"), OrderedDict<Tensor>{{"x", x_}});
  EXPECT_EQ(run(fmt::format("--model mlp --data '{}'", dir_.file("no-labels.safetensors"))), 1);
  EXPECT_NE(stderr_.find("no-labels.safetensors must hold x [steps, batch, ...] and y"), std::string::npos) << stderr_;

  EXPECT_EQ(run(fmt::format("--model gpt --data '{}'", dir_.file("data.safetensors"))), 1);
  EXPECT_NE(stderr_.find("hold no GPT"), std::string::npos) << stderr_;

  EXPECT_EQ(run("--model mlp"), 2) << "--data is required";
  EXPECT_NE(stderr_.find("--data"), std::string::npos) << stderr_;
}

}  // namespace
}  // namespace mpt
