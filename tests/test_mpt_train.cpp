// mpt-train end to end, on the CPU: a short run learns (test accuracy far
// above the 10% of guessing), a run stopped and resumed ends bit-identical
// to an uninterrupted one (with another number of loader workers, too),
// truncated, corrupted or mismatched checkpoints are refused with a message,
// and so are wrong options, before any training. On a GPU (skipped without
// one) the step runs as a CUDA graph: it trains as the eager step does,
// resumes bit-identically, and carries DDP's all-reduces.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "models/checkpoint.h"
#include "models/fashion_mnist.h"
#include "parallel/free_port.h"
#include "tests/test_util.h"

#ifndef MPT_TRAIN_PATH
#error "MPT_TRAIN_PATH must name the mpt-train binary"
#endif

namespace {
// Beside the test binary first: the build folder may have been copied.
std::string mpt_train() { return mpt::testing::build_file("../tools/mpt-train/mpt-train", MPT_TRAIN_PATH); }
#ifdef MPT_RUN_PATH
std::string mpt_run() { return mpt::testing::build_file("../tools/mpt-run/mpt-run", MPT_RUN_PATH); }
#endif
}  // namespace


namespace mpt {
namespace {

namespace fs = std::filesystem;

class MptTrain : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(data::kFashionMnistDir)) GTEST_SKIP() << "skipped: Fashion-MNIST is not installed";
  }
  std::string file(const std::string& name) const { return dir_.file(name); }

  // A GPT small enough for many quick runs, on 600 bytes of text written
  // here: 584 windows of 16, the last 58 held out and 16 more between, 510
  // to train on (8 batches of 64, the last one short). The flags that say
  // so; a test adds its own.
  std::string tiny_gpt() const {
    std::string text;
    while (text.size() < 600) text += "the quick brown fox jumps over the lazy dog. ";
    text.resize(600);
    std::ofstream(file("text.txt")) << text;
    return fmt::format("--model gpt --data '{}' --gpt-layers 1 --gpt-heads 2 --gpt-d-model 16 --context 16",
                       file("text.txt"));
  }

  // Runs mpt-train with `args` (on the CPU unless told; `env`: variable
  // assignments before the command); returns its exit status, keeps its
  // output.
  int run(const std::string& args, const std::string& device = "cpu", const std::string& env = "") {
    const std::string cmd = fmt::format("{} '{}' --device {} --progress lines {} >'{}' 2>'{}'", env, mpt_train(), device,
                                        args, file("stdout"), file("stderr"));
    const int rc = std::system(cmd.c_str());
    stdout_ = slurp(file("stdout"));
    stderr_ = slurp(file("stderr"));
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  }
  static std::string slurp(const std::string& path) {
    std::ifstream in(path);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  }

  mpt::testing::TempDir dir_{"mpt-train-test"};
  std::string stdout_, stderr_;
};

std::vector<nlohmann::json> json_lines(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

// The entries of a metrics file for one event ("epoch", "start", ...), in order.
std::vector<nlohmann::json> events(const std::string& path, const std::string& event) {
  std::vector<nlohmann::json> out;
  for (const auto& l : json_lines(path))
    if (l["event"] == event) out.push_back(l);
  return out;
}

// Every tensor of a checkpoint, as raw bytes, by name.
std::map<std::string, std::vector<double>> tensors_of(const std::string& path) {
  std::map<std::string, std::vector<double>> out;
  const ckpt::Checkpoint c = ckpt::read_checkpoint(path);
  for (const auto& [k, t] : c.model) out["model:" + k] = t.to_vector<double>();
  for (const auto& [k, t] : c.optimizer) out["optimizer:" + k] = t.to_vector<double>();
  return out;
}

// Every model weight of a checkpoint, in name order, as one list.
std::vector<double> model_values(const std::string& path) {
  std::vector<double> out;
  for (const auto& [key, values] : tensors_of(path))
    if (key.rfind("model:", 0) == 0) out.insert(out.end(), values.begin(), values.end());
  return out;
}

TEST_F(MptTrain, AShortRunLearns) {
  const std::string metrics = file("m.jsonl");
  ASSERT_EQ(run(fmt::format("--steps 60 --log-every 20 --eval-batches 4 --metrics '{}'", metrics)), 0) << stderr_;
  const auto lines = json_lines(metrics);
  ASSERT_GE(lines.size(), 5u);
  EXPECT_EQ(lines.front()["event"], "start");
  int step_lines = 0;
  const nlohmann::json* epoch = nullptr;
  for (const auto& l : lines) {
    if (l["event"] == "step") {
      ++step_lines;
      EXPECT_EQ(l["epoch"], 1) << l.dump();  // counted from 1, as the epoch summaries are
    }
    if (l["event"] == "epoch") epoch = &l;
  }
  EXPECT_EQ(step_lines, 3);  // steps 20, 40, 60
  ASSERT_NE(epoch, nullptr);
  EXPECT_EQ((*epoch)["epoch"], 1);
  for (const char* key : {"train_loss", "train_accuracy", "eval_loss", "eval_accuracy", "samples_per_s", "scale",
                          "skipped_steps"})
    EXPECT_TRUE(epoch->contains(key)) << key;
  const nlohmann::json& end = lines.back();
  EXPECT_EQ(end["event"], "end");
  EXPECT_EQ(end["steps"], 60);
  // Ten classes: guessing gives 10%. 60 steps of 128 images reach far more.
  EXPECT_GT(end["eval_accuracy"].get<double>(), 0.6) << stdout_;
  EXPECT_NE(stdout_.find("epoch 1/2 done"), std::string::npos) << stdout_;
}

// --data may name a folder holding another copy of Fashion-MNIST: the same
// files there train exactly as Debian's copy does.
TEST_F(MptTrain, AFolderOfFashionMnistTrainsAsDebiansCopy) {
  const fs::path copy = file("fmnist");
  fs::create_directory(copy);
  for (const char* name : {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                           "t10k-labels-idx1-ubyte.gz"})
    fs::create_symlink(fs::path(data::kFashionMnistDir) / name, copy / name);
  const std::string common = "--steps 5 --eval-batches 2 --precision fp32";
  ASSERT_EQ(run(fmt::format("{} --data '{}' --metrics '{}'", common, copy.string(), file("copy.jsonl"))), 0) << stderr_;
  ASSERT_EQ(run(fmt::format("{} --metrics '{}'", common, file("debian.jsonl"))), 0) << stderr_;
  const auto from_copy = events(file("copy.jsonl"), "end"), from_debian = events(file("debian.jsonl"), "end");
  ASSERT_EQ(from_copy.size(), 1u);
  ASSERT_EQ(from_debian.size(), 1u);
  EXPECT_EQ(from_copy[0]["eval_loss"], from_debian[0]["eval_loss"]);
  EXPECT_EQ(from_copy[0]["steps"], 5);
}

// --mlp-hidden sets the MLP's hidden layers (mlp_large's widths on real data,
// say); a run's widths are part of what it is, so a resumption may not
// change them.
TEST_F(MptTrain, MlpHiddenSetsTheWidthsAndStaysWithTheRun) {
  const std::string checkpoint = file("widths.ckpt");
  ASSERT_EQ(run(fmt::format("--mlp-hidden 48,24 --steps 3 --eval-batches 1 --precision fp32 --checkpoint '{}'",
                            checkpoint)),
            0)
      << stderr_;
  // 784 x 48 + 48 + 48 x 24 + 24 + 24 x 10 + 10 parameters.
  EXPECT_NE(stdout_.find("mlp 784-48-24-10 on Fashion-MNIST"), std::string::npos) << stdout_;
  EXPECT_NE(stdout_.find("39106 parameters"), std::string::npos) << stdout_;
  EXPECT_NE(run(fmt::format("--resume '{}' --mlp-hidden 32 --steps 4", checkpoint)), 0);
  EXPECT_NE(stderr_.find("--mlp-hidden [32] differs from the run in the checkpoint, which has [48,24]"),
            std::string::npos)
      << stderr_;
  EXPECT_EQ(run("--mlp-hidden 48,0 --steps 1"), 2);
  EXPECT_NE(stderr_.find("--mlp-hidden"), std::string::npos) << stderr_;
}

// --fp8-forward-accumulation is part of the run: kept in its checkpoint and
// refused when a resume asks for the other. (The CPU's products are f32
// either way; test_cuda_fp8's LinearForwardSumsAsTheRecipeAsks checks that
// the GPU's forward products take it.)
TEST_F(MptTrain, Fp8ForwardAccumulationStaysWithTheRun) {
  const std::string checkpoint = file("fp8.ckpt");
  ASSERT_EQ(run(fmt::format("--precision fp8 --fp8-forward-accumulation f32 --mlp-hidden 32 --steps 2 "
                            "--eval-batches 1 --checkpoint '{}'",
                            checkpoint)),
            0)
      << stderr_;
  EXPECT_NE(run(fmt::format("--resume '{}' --fp8-forward-accumulation fast --steps 3", checkpoint)), 0);
  EXPECT_NE(stderr_.find("--fp8-forward-accumulation 'fast' differs from the run in the checkpoint, which has 'f32'"),
            std::string::npos)
      << stderr_;
  EXPECT_EQ(run(fmt::format("--resume '{}' --steps 3", checkpoint)), 0) << stderr_;
  EXPECT_EQ(run("--precision fp8 --fp8-forward-accumulation f16 --steps 1"), 2);
  EXPECT_NE(stderr_.find("--fp8-forward-accumulation"), std::string::npos) << stderr_;
}

// --schedule linear: the warm-up, then equal steps down to the floor; each
// step's metrics line has the lr that step used.
TEST_F(MptTrain, ALinearScheduleStepsDownEvenly) {
  const std::string metrics = file("m.jsonl");
  ASSERT_EQ(run(fmt::format("--steps 6 --warmup-steps 2 --schedule linear --lr 0.01 --min-lr-ratio 0.1 "
                            "--log-every 1 --eval-batches 1 --metrics '{}'",
                            metrics)),
            0)
      << stderr_;
  std::vector<double> lrs;
  for (const auto& l : events(metrics, "step")) lrs.push_back(l["lr"].get<double>());
  // Warm-up 0.005, 0.01; then from 0.01 down to 0.001 over 4 steps.
  const std::vector<double> expected{0.005, 0.01, 0.01, 0.00775, 0.0055, 0.00325};
  ASSERT_EQ(lrs.size(), expected.size());
  for (size_t i = 0; i < lrs.size(); ++i) EXPECT_NEAR(lrs[i], expected[i], 1e-15) << "step " << i + 1;
}

TEST_F(MptTrain, StoppedAndResumedRunEndsBitIdentical) {
  const std::string common = "--batch-size 32 --accumulation 2 --steps 12 --warmup-steps 4 --eval-batches 1 --seed 7";
  ASSERT_EQ(run(fmt::format("{} --workers 2 --checkpoint '{}'", common, file("whole.safetensors"))), 0) << stderr_;
  // --stop-after ends as an interruption does (checkpoint, no evaluation of
  // the unfinished epoch, an "interrupted" event), but with status 0.
  ASSERT_EQ(run(fmt::format("{} --workers 0 --stop-after 5 --checkpoint '{}' --metrics '{}'", common,
                            file("part.safetensors"), file("part.jsonl"))),
            0)
      << stderr_;
  EXPECT_EQ(ckpt::read_checkpoint(file("part.safetensors")).step, 5);
  EXPECT_NE(stdout_.find(fmt::format("stopped (--stop-after) after step 5; --resume '{}' continues",
                                     file("part.safetensors"))),
            std::string::npos)
      << stdout_;
  EXPECT_EQ(stdout_.find("epoch 1/2 done"), std::string::npos) << stdout_;
  const auto part_lines = json_lines(file("part.jsonl"));
  ASSERT_FALSE(part_lines.empty());
  for (const auto& l : part_lines) EXPECT_NE(l["event"], "epoch") << l.dump();
  EXPECT_EQ(part_lines.back()["event"], "interrupted");
  EXPECT_EQ(part_lines.back()["reason"], "stop-after");
  EXPECT_EQ(part_lines.back()["steps"], 5);
  EXPECT_NE(tensors_of(file("part.safetensors")), tensors_of(file("whole.safetensors")));
  ASSERT_EQ(run(fmt::format("{} --workers 1 --resume '{}' --checkpoint '{}'", common, file("part.safetensors"),
                            file("part.safetensors"))),
            0)
      << stderr_;
  EXPECT_NE(stdout_.find("resumed from"), std::string::npos);
  const ckpt::Checkpoint whole = ckpt::read_checkpoint(file("whole.safetensors"));
  const ckpt::Checkpoint resumed = ckpt::read_checkpoint(file("part.safetensors"));
  EXPECT_EQ(resumed.step, 12);
  EXPECT_EQ(resumed.position.epoch, whole.position.epoch);
  EXPECT_EQ(resumed.position.batch, whole.position.batch);
  EXPECT_EQ(tensors_of(file("part.safetensors")), tensors_of(file("whole.safetensors")));
}

// A stop right after an epoch's last step: that epoch is summed up before
// the stop, and the resumed run starts the next epoch (it used to sum up
// the finished one again, from no steps: a train loss of 0).
TEST_F(MptTrain, AStopAtAnEpochsEndSumsItUpAndTheResumptionStartsTheNext) {
  const std::string common = tiny_gpt() + " --batch-size 64 --epochs 2 --eval-batches 1 --seed 7";
  ASSERT_EQ(run(fmt::format("{} --checkpoint '{}'", common, file("whole.safetensors"))), 0) << stderr_;
  ASSERT_EQ(run(fmt::format("{} --stop-after 8 --checkpoint '{}' --metrics '{}'", common, file("part.safetensors"),
                            file("part.jsonl"))),
            0)
      << stderr_;
  std::vector<nlohmann::json> epochs;
  for (const auto& l : json_lines(file("part.jsonl")))
    if (l["event"] == "epoch") epochs.push_back(l);
  ASSERT_EQ(epochs.size(), 1u);
  EXPECT_EQ(epochs[0]["epoch"], 1);
  EXPECT_EQ(epochs[0]["step"], 8);
  ASSERT_EQ(run(fmt::format("{} --resume '{}' --checkpoint '{}' --metrics '{}'", common, file("part.safetensors"),
                            file("part.safetensors"), file("resumed.jsonl"))),
            0)
      << stderr_;
  epochs.clear();
  for (const auto& l : json_lines(file("resumed.jsonl")))
    if (l["event"] == "epoch") epochs.push_back(l);
  ASSERT_EQ(epochs.size(), 1u);
  EXPECT_EQ(epochs[0]["epoch"], 2);
  EXPECT_GT(epochs[0]["train_loss"].get<double>(), 0.0);
  EXPECT_EQ(tensors_of(file("part.safetensors")), tensors_of(file("whole.safetensors")));
}

// An epoch a stop cut in two is summed up whole by the resumed run: its
// training loss, accuracy and skipped steps are those of an unbroken run
// (the resumed run used to count only the steps after the stop). A finished
// run resumed again has nothing to train and reports its test figures.
TEST_F(MptTrain, AResumedEpochIsSummedUpWhole) {
  // 8 steps; fp16 from 2^22, so the first four overflow and are skipped
  // (three before the stop, one after).
  const std::string common =
      tiny_gpt() + " --batch-size 64 --epochs 1 --eval-batches 1 --seed 7 --precision fp16 --init-scale 4194304";
  ASSERT_EQ(run(fmt::format("{} --metrics '{}'", common, file("whole.jsonl"))), 0) << stderr_;
  ASSERT_EQ(run(fmt::format("{} --stop-after 3 --checkpoint '{}'", common, file("part.safetensors"))), 0) << stderr_;
  ASSERT_EQ(run(fmt::format("{} --resume '{}' --checkpoint '{}' --metrics '{}'", common, file("part.safetensors"),
                            file("part.safetensors"), file("resumed.jsonl"))),
            0)
      << stderr_;
  const auto whole = events(file("whole.jsonl"), "epoch"), resumed = events(file("resumed.jsonl"), "epoch");
  ASSERT_EQ(whole.size(), 1u);
  ASSERT_EQ(resumed.size(), 1u);
  EXPECT_GT(whole[0]["skipped_steps"].get<int64_t>(), 0) << "the test needs skipped steps before the stop";
  EXPECT_EQ(resumed[0]["skipped_steps"], whole[0]["skipped_steps"]);
  EXPECT_EQ(resumed[0]["train_accuracy"], whole[0]["train_accuracy"]);
  const double loss = whole[0]["train_loss"].get<double>();
  EXPECT_NEAR(resumed[0]["train_loss"].get<double>(), loss, 1e-12 * loss);

  const double eval_loss = events(file("resumed.jsonl"), "end").at(0)["eval_loss"].get<double>();
  ASSERT_EQ(run(fmt::format("{} --resume '{}' --metrics '{}'", common, file("part.safetensors"), file("again.jsonl"))),
            0)
      << stderr_;
  const auto end = events(file("again.jsonl"), "end");
  ASSERT_EQ(end.size(), 1u);
  EXPECT_EQ(end[0]["steps"], 8);
  EXPECT_GT(eval_loss, 0.0);
  EXPECT_EQ(end[0]["eval_loss"].get<double>(), eval_loss);
}

// A GPT run shows text sampled from its model after each epoch, going on
// from the prompt in characters of the text; the draws depend on the seed
// and the step only, so a resumed run samples what an unbroken one does.
TEST_F(MptTrain, AGptRunSamplesTextAfterEachEpoch) {
  const std::string base = tiny_gpt() + " --batch-size 64 --epochs 2 --eval-batches 1 --seed 7";
  const std::string common = base + " --sample-tokens 40 --sample-prompt 'the '";
  ASSERT_EQ(run(fmt::format("{} --metrics '{}' --checkpoint '{}'", common, file("whole.jsonl"),
                            file("whole.safetensors"))),
            0)
      << stderr_;
  const auto samples = events(file("whole.jsonl"), "sample");
  ASSERT_EQ(samples.size(), 2u);
  const std::string alphabet = "the quick brown fox jumps over the lazy dog. ";
  for (size_t i = 0; i < samples.size(); ++i) {
    EXPECT_EQ(samples[i]["step"], 8 * (i + 1));
    EXPECT_EQ(samples[i]["prompt"], "the ");
    const std::string text = samples[i]["text"];
    ASSERT_EQ(text.size(), 40u);
    EXPECT_EQ(text.find_first_not_of(alphabet), std::string::npos) << text;
    EXPECT_NE(stdout_.find(fmt::format("sample after step {} (temperature 0.8):\nthe {}", 8 * (i + 1), text)),
              std::string::npos)
        << stdout_;
  }
  EXPECT_NE(samples[0]["text"], samples[1]["text"]);

  ASSERT_EQ(run(fmt::format("{} --stop-after 12 --checkpoint '{}'", common, file("part.safetensors"))), 0) << stderr_;
  ASSERT_EQ(run(fmt::format("{} --resume '{}' --metrics '{}'", common, file("part.safetensors"), file("rest.jsonl"))),
            0)
      << stderr_;
  const auto resumed = events(file("rest.jsonl"), "sample");
  ASSERT_EQ(resumed.size(), 1u);
  EXPECT_EQ(resumed[0], samples[1]);

  // The finished run resumed trains nothing and samples once more: a way
  // to draw text from a checkpoint, with another prompt and length.
  ASSERT_EQ(run(fmt::format("{} --resume '{}' --sample-tokens 30 --sample-prompt 'lazy' --metrics '{}'", base,
                            file("whole.safetensors"), file("again.jsonl"))),
            0)
      << stderr_;
  const auto again = events(file("again.jsonl"), "sample");
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0]["step"], 16);
  EXPECT_EQ(again[0]["prompt"], "lazy");
  EXPECT_EQ(again[0]["text"].get<std::string>().size(), 30u);

  ASSERT_EQ(run(fmt::format("{} --steps 8 --sample-tokens 0 --metrics '{}'", base, file("none.jsonl"))), 0);
  EXPECT_TRUE(events(file("none.jsonl"), "sample").empty());
  EXPECT_EQ(stdout_.find("sample after"), std::string::npos) << stdout_;

  // A prompt the text's characters cannot spell is refused before training.
  EXPECT_EQ(run(fmt::format("{} --sample-prompt 'the Zebra'", base)), 1);
  EXPECT_NE(stderr_.find("mpt-train: --sample-prompt: CharDataset::encode: byte 4 of 'the Zebra' (0x5a) is not in "
                         "the vocabulary"),
            std::string::npos)
      << stderr_;
  EXPECT_EQ(stdout_.find("first input batch"), std::string::npos) << stdout_;
}

// Sizes near the int64 limit count without overflow: a batch and an
// accumulation that take the whole text at once, and epochs without end
// that --steps bounds (the counts used to wrap, and the run ended at once
// with 0 steps).
TEST_F(MptTrain, HugeSizesCountWithoutOverflow) {
  const std::string huge = "9223372036854775807";
  ASSERT_EQ(run(fmt::format("{} --batch-size {} --accumulation {} --epochs {} --steps 2 --eval-batches 1 --metrics '{}'",
                            tiny_gpt(), huge, huge, huge, file("m.jsonl"))),
            0)
      << stderr_;
  const auto epochs = events(file("m.jsonl"), "epoch");
  ASSERT_EQ(epochs.size(), 2u);  // one step an epoch: the whole text in one batch
  EXPECT_EQ(epochs[1]["step"], 2);
  EXPECT_EQ(events(file("m.jsonl"), "end").at(0)["steps"], 2);
}

// A real interruption: SIGTERM arrives at some step k; the run finishes that
// step, checkpoints and exits with 130. Resumed up to step k + 3, it equals
// a run that went to k + 3 without a break (both planned for 2000 steps).
TEST_F(MptTrain, SignalledRunCheckpointsAndResumesBitIdentical) {
  const std::string common = "--batch-size 16 --steps 2000 --eval-batches 1 --seed 3 --log-every 1";
  // A script file spares one layer of shell quoting.
  std::ofstream(file("interrupt.sh")) << fmt::format(
      "'{}' --device cpu --progress none {} --metrics '{}' --checkpoint '{}' &\n"
      "pid=$!\n"
      "for i in $(seq 1200); do grep -q '\"step\"' '{}' 2>/dev/null && break; sleep 0.05; done\n"
      "kill -TERM $pid\n"
      "wait $pid\n"
      "echo $? >'{}'\n",
      mpt_train(), common, file("m.jsonl"), file("cut.safetensors"), file("m.jsonl"), file("rc"));
  ASSERT_EQ(std::system(fmt::format("bash '{}' 2>'{}'", file("interrupt.sh"), file("interrupt.err")).c_str()), 0);
  EXPECT_EQ(slurp(file("rc")), "130\n");
  EXPECT_NE(slurp(file("interrupt.err")).find("stopping after this step; a second signal ends it now"),
            std::string::npos);
  const int64_t k = ckpt::read_checkpoint(file("cut.safetensors")).step;
  ASSERT_GE(k, 1);
  ASSERT_LT(k, 2000);

  ASSERT_EQ(run(fmt::format("{} --stop-after {} --resume '{}' --checkpoint '{}'", common, k + 3,
                            file("cut.safetensors"), file("cut.safetensors"))),
            0)
      << stderr_;
  ASSERT_EQ(run(fmt::format("{} --stop-after {} --checkpoint '{}'", common, k + 3, file("whole.safetensors"))), 0)
      << stderr_;
  EXPECT_EQ(ckpt::read_checkpoint(file("cut.safetensors")).step, k + 3);
  EXPECT_EQ(tensors_of(file("cut.safetensors")), tensors_of(file("whole.safetensors")));
}

TEST_F(MptTrain, BadCheckpointsAreRefusedWithTheReason) {
  const std::string ck = file("c.safetensors");
  ASSERT_EQ(run(fmt::format("--batch-size 16 --steps 2 --eval-batches 1 --checkpoint '{}'", ck)), 0) << stderr_;
  std::ifstream in(ck, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), {});

  const std::string bad = file("bad.safetensors");
  std::vector<char> flipped = bytes;
  flipped[flipped.size() - 100] ^= 0x01;
  std::ofstream(bad, std::ios::binary).write(flipped.data(), flipped.size());
  EXPECT_EQ(run(fmt::format("--steps 4 --resume '{}'", bad)), 1);
  EXPECT_NE(stderr_.find("corrupted"), std::string::npos) << stderr_;

  std::ofstream(bad, std::ios::binary | std::ios::trunc).write(bytes.data(), bytes.size() / 2);
  EXPECT_EQ(run(fmt::format("--steps 4 --resume '{}'", bad)), 1);
  EXPECT_NE(stderr_.find(bad), std::string::npos) << stderr_;
  EXPECT_NE(stderr_.find("bytes"), std::string::npos) << stderr_;

  EXPECT_EQ(run(fmt::format("--model cnn --batch-size 16 --steps 4 --resume '{}'", ck)), 1);
  EXPECT_NE(stderr_.find("'mlp'"), std::string::npos) << stderr_;
  EXPECT_EQ(run(fmt::format("--batch-size 32 --steps 4 --resume '{}'", ck)), 1);
  EXPECT_NE(stderr_.find("--batch-size 32 differs from the run in the checkpoint, which has 16"), std::string::npos)
      << stderr_;
  EXPECT_EQ(run(fmt::format("--optimizer sgd --batch-size 16 --steps 4 --resume '{}'", ck)), 1);
  EXPECT_NE(stderr_.find("--optimizer 'sgd' differs from the run in the checkpoint, which has 'adamw'"),
            std::string::npos)
      << stderr_;

  // The precision is the run's (bf16 by default on the CPU): its
  // checkpoint has no loss-scaler state for an fp16 run, and fp32 would
  // round other numbers.
  for (const char* other : {"fp16", "fp32"}) {
    EXPECT_EQ(run(fmt::format("--precision {} --batch-size 16 --steps 4 --resume '{}'", other, ck)), 1);
    EXPECT_NE(stderr_.find(fmt::format("--precision '{}' differs from the run in the checkpoint, which has 'bf16'",
                                       other)),
              std::string::npos)
        << stderr_;
  }
}

// fp16 autocast with the loss scaler (small growth interval, so the scale
// moves): a stopped and resumed run ends bit-identical, scaler state included.
TEST_F(MptTrain, MixedPrecisionRunResumesBitIdenticalWithItsScaler) {
  const std::string common =
      "--precision fp16 --init-scale 1024 --growth-interval 2 --batch-size 16 --steps 6 --eval-batches 1 --seed 5";
  ASSERT_EQ(run(fmt::format("{} --checkpoint '{}'", common, file("whole.safetensors"))), 0) << stderr_;
  ASSERT_EQ(run(fmt::format("{} --stop-after 3 --checkpoint '{}'", common, file("part.safetensors"))), 0) << stderr_;
  // The scaler's rule is the run's: another growth interval is refused,
  // not overridden by the checkpoint's.
  std::string other_interval = common;
  other_interval.replace(other_interval.find("--growth-interval 2"), 19, "--growth-interval 500");
  EXPECT_NE(run(fmt::format("{} --resume '{}'", other_interval, file("part.safetensors"))), 0);
  EXPECT_NE(stderr_.find("--growth-interval 500 differs from the run in the checkpoint, which has 2"),
            std::string::npos)
      << stderr_;
  // So is its policy: the hysteresis policy would read the same state otherwise.
  EXPECT_EQ(run(fmt::format("{} --scaler hysteresis --resume '{}'", common, file("part.safetensors"))), 1);
  EXPECT_NE(stderr_.find("--scaler 'hysteresis' differs from the run in the checkpoint, which has 'dynamic'"),
            std::string::npos)
      << stderr_;
  ASSERT_EQ(run(fmt::format("{} --resume '{}' --checkpoint '{}'", common, file("part.safetensors"),
                            file("part.safetensors"))),
            0)
      << stderr_;
  const ckpt::Checkpoint whole = ckpt::read_checkpoint(file("whole.safetensors"));
  const ckpt::Checkpoint resumed = ckpt::read_checkpoint(file("part.safetensors"));
  EXPECT_EQ(tensors_of(file("part.safetensors")), tensors_of(file("whole.safetensors")));
  ASSERT_TRUE(whole.extra.contains("scaler.scale"));
  EXPECT_EQ(resumed.extra.at("scaler.scale").item(), whole.extra.at("scaler.scale").item());
  EXPECT_EQ(whole.extra.at("scaler.scale").item(), 1024.0 * 8);  // grew at steps 2, 4 and 6
}

// --parallel dp over two virtual CPU devices trains as one device does.
TEST_F(MptTrain, DataParallelOverTwoCpuDevicesMatchesOneDevice) {
  const std::string common = "--precision fp32 --batch-size 32 --accumulation 2 --steps 4 --eval-batches 1 --seed 2";
  ASSERT_EQ(run(fmt::format("{} --parallel none --checkpoint '{}'", common, file("one.safetensors"))), 0) << stderr_;
  ASSERT_EQ(run(fmt::format("{} --parallel dp --checkpoint '{}'", common, file("dp.safetensors"))), 0) << stderr_;
  const std::vector<double> one = model_values(file("one.safetensors")), dp = model_values(file("dp.safetensors"));
  ASSERT_EQ(one.size(), dp.size());
  EXPECT_LE(testing::rel_error(dp, one), 1e-5);  // summed in another order: equal up to rounding
}

TEST_F(MptTrain, GptTrainsOnText) {
  const std::string metrics = file("g.jsonl");
  ASSERT_EQ(run(fmt::format("--model gpt --gpt-layers 1 --gpt-heads 2 --gpt-d-model 32 --context 32 --batch-size 8 "
                            "--steps 30 --lr 3e-3 --eval-batches 1 --log-every 1 --metrics '{}'",
                            metrics)),
            0)
      << stderr_;
  const auto lines = json_lines(metrics);
  double first = 0, last = 0;
  for (const auto& l : lines)
    if (l["event"] == "step") (first == 0 ? first : last) = l["loss"].get<double>();
  EXPECT_LT(last, first) << "loss " << first << " -> " << last;
}

// A text file whose name is not UTF-8 (Latin-1 "é"): its checkpoint is
// written (the name kept with the byte replaced) and a resumed run on the
// same file is accepted.
TEST_F(MptTrain, ADataPathThatIsNotUtf8IsCheckpointedAndResumed) {
  const std::string text = file("caf\xe9.txt");
  {
    std::ofstream out(text);
    for (int i = 0; i < 200; ++i) out << "the quick brown fox jumps over the lazy dog " << i << "\n";
  }
  const std::string common = fmt::format(
      "--model gpt --gpt-layers 1 --gpt-heads 2 --gpt-d-model 16 --context 16 --batch-size 4 --eval-batches 1 "
      "--data '{}' --checkpoint '{}'",
      text, file("t.safetensors"));
  ASSERT_EQ(run(common + " --steps 4 --stop-after 2"), 0) << stderr_;
  ASSERT_EQ(run(fmt::format("{} --steps 4 --resume '{}'", common, file("t.safetensors"))), 0) << stderr_;
  EXPECT_NE(stdout_.find("resumed from"), std::string::npos) << stdout_;
}

// The step-time breakdown: every logging step and every epoch summary
// carries mean milliseconds per phase, which add up to about the step's
// wall-clock time; a single process has nothing to communicate.
constexpr const char* kPhases[] = {"data_wait_ms", "forward_ms",   "backward_ms", "comm_ms",
                                   "optimizer_ms", "graph_ms", "other_ms"};

void expect_breakdown(const nlohmann::json& l, bool communicates) {
  SCOPED_TRACE(l.dump());
  double sum = 0;
  for (const char* key : kPhases) {
    ASSERT_TRUE(l.contains(key)) << key;
    EXPECT_GE(l[key].get<double>(), 0.0) << key;
    sum += l[key].get<double>();
  }
  for (const char* key : {"forward_ms", "backward_ms", "optimizer_ms"}) EXPECT_GT(l[key].get<double>(), 0.0) << key;
  if (communicates) EXPECT_GT(l["comm_ms"].get<double>(), 0.0);
  else EXPECT_EQ(l["comm_ms"].get<double>(), 0.0);
  EXPECT_EQ(l["graph_ms"].get<double>(), 0.0);  // the CPU has no graphs
  const double step = l["step_ms"].get<double>();
  EXPECT_GT(step, 0.0);
  // The phases cover the step from its data wait to the optimizer; only the
  // logging between steps (and the first step's set-up) lies outside.
  EXPECT_LE(sum, step * 1.05);
  EXPECT_GE(sum, step * 0.6);
}

TEST_F(MptTrain, MetricsBreakEachStepIntoPhases) {
  const std::string metrics = file("m.jsonl");
  ASSERT_EQ(run(fmt::format("--steps 30 --log-every 10 --batch-size 64 --eval-batches 1 --metrics '{}'", metrics)), 0)
      << stderr_;
  int step_lines = 0, epoch_lines = 0;
  for (const auto& l : json_lines(metrics)) {
    if (l["event"] == "step") {
      ++step_lines;
      expect_breakdown(l, false);
    }
    if (l["event"] == "epoch") {
      ++epoch_lines;
      expect_breakdown(l, false);
    }
    if (l["event"] == "rank") {
      EXPECT_EQ(l["rank"], 0);
      EXPECT_EQ(l["world_size"], 1);
      EXPECT_EQ(l["device"], "cpu");
    }
  }
  EXPECT_EQ(step_lines, 3);
  EXPECT_EQ(epoch_lines, 1);
  testing::expect_contains(stdout_, {"rank 0 of 1: host ", fmt::format("pid "), "device cpu",
                                     "rank 0 of 1: first input batch f32[64, 1, 28, 28] on cpu", "ms/step",
                                     "data_wait_ms"});
  EXPECT_EQ(stdout_.find("first input batch", stdout_.find("first input batch") + 1), std::string::npos)
      << "printed once";
}

// DataParallel over two virtual CPU devices: the parameter broadcast and
// the gradient sum show up as communication.
TEST_F(MptTrain, DataParallelStepsShowTheirCommunication) {
  const std::string metrics = file("m.jsonl");
  ASSERT_EQ(run(fmt::format("--parallel dp --precision fp32 --steps 6 --log-every 3 --batch-size 32 --eval-batches 1 "
                            "--metrics '{}'",
                            metrics)),
            0)
      << stderr_;
  int step_lines = 0;
  for (const auto& l : json_lines(metrics))
    if (l["event"] == "step") {
      ++step_lines;
      expect_breakdown(l, true);
    }
  EXPECT_EQ(step_lines, 2);
  testing::expect_contains(stdout_, {"device cpu, cpu:1 (DataParallel)", "split over the replicas"});
}

#ifdef MPT_RUN_PATH
// DDP over two ranks (Gloo) against one process on the same data: each
// rank's micro-batch of 16 is half of the single run's 32 (the ranks take
// alternate samples of the same shuffled order), the gradients averaged
// over the ranks are the single run's, and plain SGD turns any other
// scale of them (a sum, say) into other weights.
TEST_F(MptTrain, DdpOverTwoRanksTrainsAsOneProcess) {
  const std::string common =
      "--precision fp32 --optimizer sgd --momentum 0 --lr 0.1 --accumulation 2 --steps 4 --eval-batches 1 --seed 5";
  ASSERT_EQ(run(fmt::format("{} --batch-size 32 --parallel none --checkpoint '{}'", common, file("one.safetensors"))),
            0)
      << stderr_;
  const std::string cmd = fmt::format(
      "'{}' --nproc_per_node 2 --master_port {} --kill_timeout 2 '{}' --device cpu --progress none {} --batch-size 16 "
      "--parallel ddp --checkpoint '{}' >'{}' 2>&1",
      mpt_run(), testing::free_port(), mpt_train(), common, file("ddp.safetensors"), file("out"));
  ASSERT_EQ(std::system(cmd.c_str()), 0) << slurp(file("out"));
  const std::vector<double> one = model_values(file("one.safetensors")), ddp = model_values(file("ddp.safetensors"));
  ASSERT_EQ(one.size(), ddp.size());
  EXPECT_LE(testing::rel_error(ddp, one), 1e-5);  // summed in another order: equal up to rounding
}

// A GPT trained by two ranks samples its text after each epoch on every
// rank (so that none waits for another in its next all-reduce); rank 0
// alone prints and records it, and the run ends as a whole.
TEST_F(MptTrain, ADdpGptRunSamplesOnEveryRankAndRankZeroShowsIt) {
  const std::string cmd = fmt::format(
      "'{}' --nproc_per_node 2 --master_port {} --kill_timeout 2 '{}' --device cpu --progress lines {} --batch-size 32 "
      "--epochs 2 --eval-batches 1 --sample-tokens 24 --metrics '{}' >'{}' 2>&1",
      mpt_run(), testing::free_port(), mpt_train(), tiny_gpt(), file("m.jsonl"), file("out"));
  ASSERT_EQ(std::system(cmd.c_str()), 0) << slurp(file("out"));
  const std::string out = slurp(file("out"));
  int printed = 0;
  for (size_t at = out.find("[rank 0] mpt-train: sample after step "); at != std::string::npos;
       at = out.find("[rank 0] mpt-train: sample after step ", at + 1))
    ++printed;
  EXPECT_EQ(printed, 2) << out;
  EXPECT_EQ(out.find("[rank 1] mpt-train: sample"), std::string::npos) << out;
  const auto samples = events(file("m.jsonl"), "sample");
  ASSERT_EQ(samples.size(), 2u);
  for (const auto& sample : samples) EXPECT_EQ(sample["text"].get<std::string>().size(), 24u);
}

// Ranks started with different settings all end within seconds, the error
// naming each setting that differs with every rank's value (they hung in
// their first collective until --dist-timeout, blaming the network, or
// trained on apart).
TEST_F(MptTrain, RanksWithDifferentSettingsEndAtOnceNamingTheSetting) {
  const std::string script = file("per_rank.sh");
  std::ofstream(script) << fmt::format(
      "#!/bin/sh\n"
      "if [ \"$RANK\" = 0 ]; then exec '{0}' \"$@\" --precision fp32; else exec '{0}' \"$@\" --precision bf16 "
      "--batch-size 8; fi\n",
      mpt_train());
  fs::permissions(script, fs::perms::owner_all);
  const std::string cmd = fmt::format(
      "'{}' --nproc_per_node 2 --master_port {} --kill_timeout 2 '{}' --device cpu --progress none --steps 2 "
      "--parallel ddp --dist-timeout 60 >'{}' 2>&1",
      mpt_run(), testing::free_port(), script, file("out"));
  const auto started = std::chrono::steady_clock::now();
  EXPECT_NE(std::system(cmd.c_str()), 0);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  const std::string out = slurp(file("out"));
  EXPECT_LT(seconds, 10) << out;
  // Every rank finds the difference; the first to end says it, and mpt-run
  // then stops the others (which may be ended before they print theirs).
  EXPECT_NE(out.find("mpt-train: rank "), std::string::npos) << out;
  EXPECT_NE(out.find("the ranks' settings differ"), std::string::npos) << out;
  EXPECT_NE(out.find("--precision: 'fp32' on rank 0, 'bf16' on rank 1"), std::string::npos) << out;
  EXPECT_NE(out.find("--batch-size: '128' on rank 0, '8' on rank 1"), std::string::npos) << out;
}

// Two ranks through mpt-run on Gloo: each rank introduces itself, and rank
// 0's metrics carry every rank's working time per step (the imbalance check's input).
TEST_F(MptTrain, DdpRanksIntroduceThemselvesAndShareTheirStepTimes) {
  const std::string metrics = file("m.jsonl");
  const std::string cmd = fmt::format(
      "'{}' --nproc_per_node 2 --master_port {} --kill_timeout 2 '{}' --device cpu --progress lines --precision fp32 "
      "--steps 6 --log-every 3 --batch-size 32 --eval-batches 1 --metrics '{}' >'{}' 2>&1",
      mpt_run(), testing::free_port(), mpt_train(), metrics, file("out"));
  ASSERT_EQ(std::system(cmd.c_str()), 0) << slurp(file("out"));
  const std::string out = slurp(file("out"));
  testing::expect_contains(out, {"[rank 0] rank 0 of 2: host ", "[rank 1] rank 1 of 2: host ",
                                 "[rank 0] rank 0 of 2: first input batch f32[32, 1, 28, 28] on cpu",
                                 "[rank 1] rank 1 of 2: first input batch f32[32, 1, 28, 28] on cpu"});
  int step_lines = 0;
  for (const auto& l : json_lines(metrics))
    if (l["event"] == "step") {
      ++step_lines;
      expect_breakdown(l, true);
      ASSERT_EQ(l["rank_work_ms"].size(), 2u) << l.dump();
      for (const auto& ms : l["rank_work_ms"]) EXPECT_GT(ms.get<double>(), 0.0);
    }
  EXPECT_EQ(step_lines, 2);
}

// SIGTERM to one rank only: every rank stops after the same step (the
// next logging step) with the status of an interruption, and rank 0 writes
// the checkpoint there; none is left waiting in an all-reduce.
TEST_F(MptTrain, ASignalToOneDdpRankStopsEveryRankAfterTheSameStep) {
  std::ofstream(file("interrupt.sh")) << fmt::format(
      "'{}' --nproc_per_node 2 --master_port {} --kill_timeout 20 '{}' --device cpu --progress lines --precision fp32 "
      "--batch-size 16 --steps 2000 --log-every 3 --eval-batches 1 --checkpoint '{}' >'{}' 2>&1 &\n"
      "job=$!\n"
      "for i in $(seq 1200); do grep -q ' step 3 ' '{}' 2>/dev/null && break; sleep 0.05; done\n"
      "pid=$(sed -n 's/.*\\[rank 1\\] rank 1 of 2: host .*, pid \\([0-9]*\\).*/\\1/p' '{}' | head -1)\n"
      "kill -TERM $pid\n"
      "wait $job\n"
      "echo $? >'{}'\n",
      mpt_run(), testing::free_port(), mpt_train(), file("cut.safetensors"), file("out"), file("out"), file("out"),
      file("rc"));
  ASSERT_EQ(std::system(fmt::format("bash '{}'", file("interrupt.sh")).c_str()), 0);
  const std::string out = slurp(file("out"));
  EXPECT_EQ(slurp(file("rc")), "130\n") << out;
  ASSERT_TRUE(std::filesystem::exists(file("cut.safetensors"))) << out;
  const int64_t k = ckpt::read_checkpoint(file("cut.safetensors")).step;
  EXPECT_GE(k, 3);
  EXPECT_EQ(k % 3, 0) << "stopped after step " << k << ", not a logging step";
  testing::expect_contains(out, {fmt::format("[rank 0] mpt-train: interrupted after step {}", k),
                                 "failed with exit status 130"});
  EXPECT_EQ(out.find("rror"), std::string::npos) << out;
}

// --grad-transit bf16 all-reduces DDP's gradients in bf16: the model ends
// close to the f32 transit's, but not equal (the averages were rounded).
TEST_F(MptTrain, DdpWithBf16GradientTransitEndsCloseToF32) {
  auto train = [&](const std::string& transit, const std::string& checkpoint) {
    const std::string cmd = fmt::format(
        "'{}' --nproc_per_node 2 --master_port {} --kill_timeout 2 '{}' --device cpu --progress none --precision fp32 "
        "--optimizer sgd --momentum 0 --lr 0.1 --steps 4 --batch-size 32 --eval-batches 1 --seed 3 --grad-transit {} "
        "--checkpoint '{}' >'{}' 2>&1",
        mpt_run(), testing::free_port(), mpt_train(), transit, checkpoint, file("out"));
    ASSERT_EQ(std::system(cmd.c_str()), 0) << slurp(file("out"));
  };
  train("f32", file("f32.safetensors"));
  train("bf16", file("bf16.safetensors"));
  const std::vector<double> exact = model_values(file("f32.safetensors")),
                            rounded = model_values(file("bf16.safetensors"));
  ASSERT_EQ(exact.size(), rounded.size());
  // Plain SGD moves the weights by the gradients themselves: rounded to
  // bf16 (a relative 2^-9), they move them a little differently; any other
  // scale of them (a sum instead of a mean) moves them far more.
  const double error = testing::rel_error(rounded, exact);
  EXPECT_GT(error, 0.0);
  EXPECT_LE(error, 1e-3);
}
// DDP's step is captured with its all-reduces (and the loss scaler's
// found_inf all-reduce): over one rank per GPU (one or two), it trains as
// the eager DDP step does.
TEST_F(MptTrain, OnGpusADdpStepIsCapturedWithItsAllReduces) {
  MPT_SKIP_WITHOUT_CUDA();
  const int ranks = std::min(cuda_device_count(), 2);
  auto train = [&](const std::string& graph, const std::string& name) {
    const std::string cmd = fmt::format(
        "'{}' --nproc_per_node {} --master_port {} --kill_timeout 2 '{}' --parallel ddp --device cuda --progress none "
        "--epochs 1 --batch-size 2048 --accumulation 2 --eval-batches 1 --seed 6 --cuda-graph {} --metrics '{}' "
        "--checkpoint '{}' >'{}' 2>&1",
        mpt_run(), ranks, testing::free_port(), mpt_train(), graph, file(name + ".jsonl"),
        file(name + ".safetensors"), file("out"));
    ASSERT_EQ(std::system(cmd.c_str()), 0) << slurp(file("out"));
  };
  train("on", "graph");
  train("off", "eager");
  const auto graph = events(file("graph.jsonl"), "epoch"), eager = events(file("eager.jsonl"), "epoch");
  ASSERT_EQ(graph.size(), 1u);
  ASSERT_EQ(eager.size(), 1u);
  EXPECT_GT(graph[0]["graph_replays"].get<int64_t>(), 0) << graph[0].dump();
  EXPECT_NEAR(graph[0]["train_loss"].get<double>(), eager[0]["train_loss"].get<double>(),
              1e-2 * eager[0]["train_loss"].get<double>());
  const std::vector<double> g = model_values(file("graph.safetensors")), e = model_values(file("eager.safetensors"));
  EXPECT_LE(testing::rel_error(g, e), 1e-2);
}
#endif

// Wrong option values are refused before any training, naming the option:
// out of range (a usage error, status 2) or not fitting the rest of the run (1).
TEST_F(MptTrain, BadOptionsAreRefusedNamingTheOption) {
  for (const char* args : {"--log-every 0", "--eval-batches -1", "--checkpoint-every -1", "--stop-after -1",
                           "--workers -1", "--context 0", "--gpt-d-model 0", "--init-scale 0", "--lr -1",
                           "--weight-decay -0.1", "--momentum -1", "--min-lr-ratio 5", "--lr inf",
                           "--weight-decay 1e999", "--dist-timeout inf", "--init-scale nan", "--sample-tokens -1",
                           "--sample-temperature -0.5", "--sample-temperature nan", "--sample-top-k -1"}) {
    EXPECT_EQ(run(args), 2) << args;
    const std::string flag = std::string(args).substr(0, std::string(args).find(' '));
    EXPECT_NE(stderr_.find(flag + ": must be"), std::string::npos) << args << ": " << stderr_;
    EXPECT_EQ(stderr_.find("179769"), std::string::npos) << stderr_;
  }

  // The scaler's own rule, applied to its flags even where no scaler runs.
  EXPECT_EQ(run("--precision fp32 --growth-factor 0.5 --steps 1"), 2);
  EXPECT_NE(stderr_.find("mpt-train: --growth-factor must be > 1"), std::string::npos) << stderr_;
  EXPECT_EQ(run("--backoff-factor 1 --steps 1"), 2);
  EXPECT_NE(stderr_.find("mpt-train: --backoff-factor must be in (0, 1)"), std::string::npos) << stderr_;

  // GPT's heads must split its width: a usage error, before any data is read.
  EXPECT_EQ(run("--model gpt --gpt-heads 5 --gpt-d-model 384 --steps 1"), 2);
  EXPECT_NE(stderr_.find("--gpt-d-model 384 must be a multiple of --gpt-heads 5"), std::string::npos) << stderr_;

  EXPECT_EQ(run("--model gpt --data fashion-mnist --steps 1"), 1);
  EXPECT_NE(stderr_.find("--model gpt trains on text"), std::string::npos) << stderr_;
  // A text too short to hold a training window before its held-out tenth.
  std::ofstream(file("tiny.txt")) << std::string(40, 'a');
  EXPECT_EQ(run(fmt::format("--model gpt --data '{}' --context 32 --steps 1", file("tiny.txt"))), 1);
  EXPECT_NE(stderr_.find("is too short for --context 32"), std::string::npos) << stderr_;
  EXPECT_EQ(run("--model mlp --data fortunes --steps 1"), 1);
  EXPECT_NE(stderr_.find("--model mlp trains on --data fashion-mnist or a folder holding Fashion-MNIST's four .gz "
                         "files, not 'fortunes'"),
            std::string::npos)
      << stderr_;

  // A checkpoint under a regular file cannot be written: refused at the
  // start, not after the training.
  std::ofstream(file("afile")) << "not a folder";
  EXPECT_EQ(run(fmt::format("--steps 1 --checkpoint '{}'", file("afile/x.safetensors"))), 1);
  EXPECT_NE(stderr_.find(fmt::format("mpt-train: --checkpoint '{}'", file("afile/x.safetensors"))), std::string::npos)
      << stderr_;
  EXPECT_EQ(stdout_.find("first input batch"), std::string::npos) << stdout_;
}

// On a GPU the step runs as a CUDA graph unless told otherwise. Two epochs
// of 15 steps, each ending in a short batch (60000 = 14 x 4096 + 2656): the
// graph is captured again when the full batches come back, and the totals
// counted inside it, the evaluation and the weights match an eager run's up
// to the last bits that the two AdamW paths round differently.
TEST_F(MptTrain, OnAGpuTheStepIsACudaGraphThatTrainsAsTheEagerStepDoes) {
  MPT_SKIP_WITHOUT_CUDA();
  const std::string common = "--batch-size 4096 --epochs 2 --lr 3e-3 --warmup-steps 5 --eval-batches 2 --seed 4";
  ASSERT_EQ(run(fmt::format("{} --metrics '{}' --checkpoint '{}'", common, file("g.jsonl"), file("g.safetensors")),
                "cuda"),
            0)
      << stderr_;
  EXPECT_NE(stdout_.find(", CUDA graph"), std::string::npos) << stdout_;
  ASSERT_EQ(run(fmt::format("{} --cuda-graph off --metrics '{}' --checkpoint '{}'", common, file("e.jsonl"),
                            file("e.safetensors")),
                "cuda"),
            0)
      << stderr_;
  EXPECT_TRUE(events(file("g.jsonl"), "start").at(0)["cuda_graph"].get<bool>());
  EXPECT_FALSE(events(file("e.jsonl"), "start").at(0)["cuda_graph"].get<bool>());
  const auto graph = events(file("g.jsonl"), "epoch"), eager = events(file("e.jsonl"), "epoch");
  ASSERT_EQ(graph.size(), 2u);
  ASSERT_EQ(eager.size(), 2u);
  // Each epoch's full batches: three eager steps, a capture, then replays
  // (11 a epoch); the short batch runs eagerly.
  EXPECT_EQ(graph[1]["graph_captures"], 2);
  EXPECT_EQ(graph[1]["graph_replays"], 22);
  EXPECT_FALSE(eager[1].contains("graph_replays"));
  for (size_t e = 0; e < 2; ++e) {
    SCOPED_TRACE(graph[e].dump() + "\n" + eager[e].dump());
    for (const char* key : {"train_loss", "eval_loss"})
      EXPECT_NEAR(graph[e][key].get<double>(), eager[e][key].get<double>(), 1e-2 * eager[e][key].get<double>()) << key;
    for (const char* key : {"train_accuracy", "eval_accuracy"})
      EXPECT_NEAR(graph[e][key].get<double>(), eager[e][key].get<double>(), 5e-3) << key;
    EXPECT_GT(graph[e]["train_accuracy"].get<double>(), 0.5);
    EXPECT_EQ(graph[e]["skipped_steps"], eager[e]["skipped_steps"]);
    EXPECT_EQ(graph[e]["scale"], eager[e]["scale"]);
    EXPECT_GT(graph[e]["graph_ms"].get<double>(), 0.0);
    EXPECT_EQ(eager[e]["graph_ms"].get<double>(), 0.0);
    EXPECT_GT(eager[e]["forward_ms"].get<double>(), 0.0);
  }
  const std::vector<double> g = model_values(file("g.safetensors")), e = model_values(file("e.safetensors"));
  EXPECT_LE(testing::rel_error(g, e), 1e-2);
}

// SGD with momentum is captured too (its counts, rate and skip decision on
// the device) and trains as its eager step does: the same kernel with the
// same rate, so only the scaler's decision moves from host to device. A
// scale of 2^24 overflows the first steps, so the momentum starts at the
// first update after them.
TEST_F(MptTrain, OnAGpuAnSgdStepIsACudaGraphToo) {
  MPT_SKIP_WITHOUT_CUDA();
  const std::string common =
      "--optimizer sgd --momentum 0.9 --lr 0.05 --init-scale 16777216 --batch-size 2048 --steps 24 "
      "--eval-batches 2 --seed 4";
  ASSERT_EQ(run(fmt::format("{} --cuda-graph on --metrics '{}' --checkpoint '{}'", common, file("g.jsonl"),
                            file("g.safetensors")),
                "cuda"),
            0)
      << stderr_;
  ASSERT_EQ(run(fmt::format("{} --cuda-graph off --metrics '{}' --checkpoint '{}'", common, file("e.jsonl"),
                            file("e.safetensors")),
                "cuda"),
            0)
      << stderr_;
  const auto graph = events(file("g.jsonl"), "epoch"), eager = events(file("e.jsonl"), "epoch");
  ASSERT_EQ(graph.size(), 1u);
  ASSERT_EQ(eager.size(), 1u);
  SCOPED_TRACE(graph[0].dump() + "\n" + eager[0].dump());
  EXPECT_EQ(graph[0]["graph_replays"], 21);  // three eager steps, then the captured one and its replays
  EXPECT_GT(graph[0]["skipped_steps"].get<int64_t>(), 0);
  EXPECT_GT(graph[0]["eval_accuracy"].get<double>(), 0.5);
  for (const char* key : {"train_loss", "eval_loss"})
    EXPECT_NEAR(graph[0][key].get<double>(), eager[0][key].get<double>(), 1e-6 * eager[0][key].get<double>()) << key;
  EXPECT_EQ(graph[0]["skipped_steps"], eager[0]["skipped_steps"]);
  EXPECT_EQ(graph[0]["scale"], eager[0]["scale"]);
  const std::vector<double> g = model_values(file("g.safetensors")), e = model_values(file("e.safetensors"));
  EXPECT_LE(testing::rel_error(g, e), 1e-6);
  // The momentum buffers and step counts reach the checkpoint alike.
  const auto tg = tensors_of(file("g.safetensors")), te = tensors_of(file("e.safetensors"));
  ASSERT_EQ(tg.size(), te.size());
  for (const auto& [key, values] : tg) {
    if (key.rfind("optimizer:", 0) != 0) continue;
    ASSERT_TRUE(te.contains(key)) << key;
    EXPECT_LE(testing::rel_error(values, te.at(key)), 1e-6) << key;
  }
  EXPECT_TRUE(tg.contains("optimizer:state.0.momentum_buffer"));
}

// A graph run stopped and resumed ends bit-identical to one that was not:
// an eager step and a replay of it compute alike. Accumulation 3 over 59
// batches an epoch makes the epoch's last step two batches, the last short.
TEST_F(MptTrain, OnAGpuAStoppedAndResumedGraphRunEndsBitIdentical) {
  MPT_SKIP_WITHOUT_CUDA();
  const std::string common = "--batch-size 1024 --accumulation 3 --steps 25 --warmup-steps 4 --eval-batches 1 --seed 9";
  ASSERT_EQ(run(fmt::format("{} --checkpoint '{}'", common, file("whole.safetensors")), "cuda"), 0) << stderr_;
  ASSERT_EQ(run(fmt::format("{} --stop-after 12 --checkpoint '{}'", common, file("part.safetensors")), "cuda"), 0)
      << stderr_;
  ASSERT_EQ(run(fmt::format("{} --resume '{}' --checkpoint '{}' --metrics '{}'", common, file("part.safetensors"),
                            file("part.safetensors"), file("m.jsonl")),
                "cuda"),
            0)
      << stderr_;
  // The resumed steps 13 to 25 end the first epoch (20 steps) and go into the second.
  const auto epochs = events(file("m.jsonl"), "epoch");
  ASSERT_EQ(epochs.size(), 2u);
  EXPECT_GT(epochs[0]["graph_replays"].get<int64_t>(), 0);
  EXPECT_EQ(ckpt::read_checkpoint(file("part.safetensors")).step, 25);
  EXPECT_EQ(tensors_of(file("part.safetensors")), tensors_of(file("whole.safetensors")));
}

// --cuda-graph on where the step cannot be captured says why, before training.
TEST_F(MptTrain, CudaGraphOnIsRefusedWhereTheStepCannotBeCaptured) {
  EXPECT_EQ(run("--cuda-graph on --steps 1"), 1);
  EXPECT_NE(stderr_.find("mpt-train: --cuda-graph on cannot be: the run is on cpu, not a GPU"), std::string::npos)
      << stderr_;
  EXPECT_EQ(stdout_.find("first input batch"), std::string::npos) << stdout_;
  if (!testing::has_cuda()) return;
  EXPECT_EQ(run("--cuda-graph on --parallel dp --steps 1", "cuda"), 1);
  EXPECT_NE(stderr_.find("--cuda-graph on cannot be: --parallel dp"), std::string::npos) << stderr_;
}

// The CPU's thread count comes from MPT_CPU_THREADS where it is set: a run
// on one thread trains, and a value that is not a count is refused by name.
TEST_F(MptTrain, CpuThreadsAreTakenFromTheEnvironment) {
  ASSERT_EQ(run("--steps 3 --eval-batches 1", "cpu", "MPT_CPU_THREADS=1"), 0) << stderr_;
  EXPECT_EQ(run("--steps 1 --eval-batches 1", "cpu", "MPT_CPU_THREADS=many"), 1);
  EXPECT_NE(stderr_.find("MPT_CPU_THREADS must be a whole number from 1 to 1024, got 'many'"), std::string::npos)
      << stderr_;
}

// Options that a run does not use are named on stderr, and it goes on.
TEST_F(MptTrain, UnusedOptionsAreWarnedAbout) {
  ASSERT_EQ(run("--precision bf16 --init-scale 1024 --scaler static --steps 1 --eval-batches 1"), 0) << stderr_;
  EXPECT_NE(stderr_.find("warning: --scaler, --init-scale ignored"), std::string::npos) << stderr_;
  ASSERT_EQ(run("--steps 4 --stop-after 1 --eval-batches 1"), 0) << stderr_;
  EXPECT_NE(stderr_.find("warning: --stop-after 1 without --checkpoint"), std::string::npos) << stderr_;
}

// A run never replaces another run's checkpoint unasked: a fresh run over
// an existing --checkpoint is refused (the file untouched) and names both
// ways out; --overwrite replaces it.
TEST_F(MptTrain, AnExistingCheckpointIsNotReplacedByAnotherRun) {
  const std::string ck = file("c.safetensors");
  ASSERT_EQ(run(fmt::format("--batch-size 16 --steps 2 --eval-batches 1 --checkpoint '{}'", ck)), 0) << stderr_;
  const std::string before = slurp(ck);
  EXPECT_EQ(run(fmt::format("--model cnn --batch-size 16 --steps 1 --eval-batches 1 --checkpoint '{}'", ck)), 1);
  EXPECT_NE(stderr_.find(fmt::format("--checkpoint '{}' already exists (it holds a run of mlp at step 2)", ck)),
            std::string::npos)
      << stderr_;
  EXPECT_NE(stderr_.find(fmt::format("--resume '{}'", ck)), std::string::npos) << stderr_;
  EXPECT_NE(stderr_.find("--overwrite"), std::string::npos) << stderr_;
  EXPECT_EQ(slurp(ck), before);
  ASSERT_EQ(run(fmt::format("--model cnn --batch-size 16 --steps 1 --eval-batches 1 --overwrite --checkpoint '{}'", ck)),
            0)
      << stderr_;
  const auto config = nlohmann::json::parse(ckpt::read_checkpoint(ck).info.at("run.config"));
  EXPECT_EQ(config["model"], "cnn");
}

// --auto-resume starts a run where its checkpoint is missing and continues
// it where it exists: a job that restarts itself with one command line ends
// as an uninterrupted run does.
TEST_F(MptTrain, AutoResumeStartsOrContinuesTheSameRun) {
  const std::string common = "--batch-size 16 --steps 6 --warmup-steps 2 --eval-batches 1 --seed 3";
  ASSERT_EQ(run(fmt::format("{} --checkpoint '{}'", common, file("whole.safetensors"))), 0) << stderr_;
  ASSERT_EQ(run(fmt::format("{} --auto-resume --stop-after 3 --checkpoint '{}'", common, file("part.safetensors"))), 0)
      << stderr_;
  EXPECT_EQ(stdout_.find("resumed from"), std::string::npos) << stdout_;
  EXPECT_EQ(ckpt::read_checkpoint(file("part.safetensors")).step, 3);
  ASSERT_EQ(run(fmt::format("{} --auto-resume --checkpoint '{}'", common, file("part.safetensors"))), 0) << stderr_;
  EXPECT_NE(stdout_.find("resumed from"), std::string::npos) << stdout_;
  EXPECT_EQ(tensors_of(file("part.safetensors")), tensors_of(file("whole.safetensors")));
  EXPECT_EQ(run(fmt::format("{} --auto-resume", common)), 2);  // it needs --checkpoint
}

// --gpt-preset gpt2 starts from GPT-2 small's sizes; sizes given beside it
// win (here all but the heads, so that the run stays tiny).
TEST_F(MptTrain, TheGpt2PresetGivesGpt2SizesThatOptionsOverride) {
  std::string text;
  while (text.size() < 600) text += "the quick brown fox jumps over the lazy dog. ";
  std::ofstream(file("text.txt")) << text;
  ASSERT_EQ(run(fmt::format("--model gpt --data '{}' --gpt-preset gpt2 --gpt-layers 1 --gpt-d-model 24 --context 16 "
                            "--batch-size 4 --steps 1 --eval-batches 1 --sample-tokens 0",
                            file("text.txt"))),
            0)
      << stderr_;
  EXPECT_NE(stdout_.find("gpt (1 layers, 12 heads, d 24, context 16"), std::string::npos) << stdout_;
  EXPECT_EQ(run("--model gpt --gpt-preset gpt3"), 2);
  EXPECT_NE(stderr_.find("gpt3"), std::string::npos) << stderr_;
}

// The checkpoint records the run's whole configuration: --resume alone
// continues a GPT of non-default sizes bit-identically, and an option given
// again that would change the run is refused by name with both values.
TEST_F(MptTrain, ResumeNeedsOnlyTheCheckpoint) {
  const std::string common = tiny_gpt() + " --batch-size 16 --steps 6 --warmup-steps 2 --eval-batches 1 "
                                          "--sample-tokens 0 --precision fp32 --seed 4";
  ASSERT_EQ(run(fmt::format("{} --checkpoint '{}'", common, file("whole.safetensors"))), 0) << stderr_;
  ASSERT_EQ(run(fmt::format("{} --stop-after 3 --checkpoint '{}'", common, file("part.safetensors"))), 0) << stderr_;
  EXPECT_EQ(run(fmt::format("--resume '{}' --gpt-d-model 32", file("part.safetensors"))), 1);
  EXPECT_NE(stderr_.find("--gpt-d-model 32 differs from the run in the checkpoint, which has 16"), std::string::npos)
      << stderr_;
  ASSERT_EQ(run(fmt::format("--resume '{}'", file("part.safetensors"))), 0) << stderr_;
  const ckpt::Checkpoint resumed = ckpt::read_checkpoint(file("part.safetensors"));
  EXPECT_EQ(resumed.step, 6);
  EXPECT_EQ(tensors_of(file("part.safetensors")), tensors_of(file("whole.safetensors")));
  // Options that may change do: a longer run.
  ASSERT_EQ(run(fmt::format("--resume '{}' --steps 8", file("part.safetensors"))), 0) << stderr_;
  EXPECT_EQ(ckpt::read_checkpoint(file("part.safetensors")).step, 8);
}

// A resumed run's data is compared by what it holds: the same text under
// another path, or by a relative path from another folder, is the same
// data; other text under the first name is not.
TEST_F(MptTrain, TheDataIsComparedByContentNotByPath) {
  tiny_gpt();  // writes text.txt
  fs::create_directories(file("elsewhere"));
  fs::copy_file(file("text.txt"), file("elsewhere/copy.txt"));
  const std::string model = "--model gpt --gpt-layers 1 --gpt-heads 2 --gpt-d-model 16 --context 16 --batch-size 16 "
                            "--steps 6 --eval-batches 1 --sample-tokens 0";
  ASSERT_EQ(run(fmt::format("{} --data text.txt --stop-after 2 --checkpoint '{}'", model, file("c.safetensors")), "cpu",
                fmt::format("cd '{}' &&", dir_.path().string())),
            0)
      << stderr_;
  ASSERT_EQ(run(fmt::format("--resume '{}' --data copy.txt --stop-after 4", file("c.safetensors")), "cpu",
                fmt::format("cd '{}' &&", file("elsewhere"))),
            0)
      << stderr_;
  // The checkpoint now names copy.txt: other text under that name is refused.
  std::ofstream(file("elsewhere/copy.txt")) << std::string(600, 'x');
  EXPECT_EQ(run(fmt::format("--resume '{}' --data copy.txt", file("c.safetensors")), "cpu",
                fmt::format("cd '{}' &&", file("elsewhere"))),
            1);
  EXPECT_NE(stderr_.find("the checkpoint's run trained on other data"), std::string::npos) << stderr_;
}

// The default warm-up is scaled down, and said to be, where it would fill
// a short run; a warm-up asked for that fills the run is warned about.
TEST_F(MptTrain, AWarmUpThatFillsTheRunIsShortenedOrWarnedAbout) {
  ASSERT_EQ(run(fmt::format("--batch-size 16 --steps 40 --eval-batches 1 --metrics '{}'", file("m.jsonl"))), 0)
      << stderr_;
  EXPECT_NE(stdout_.find("the default warm-up of 100 steps is over a tenth of this run's 40 steps: warming up over 4"),
            std::string::npos)
      << stdout_;
  EXPECT_EQ(events(file("m.jsonl"), "start").at(0)["warmup_steps"], 4);
  ASSERT_EQ(run("--batch-size 16 --steps 40 --warmup-steps 50 --eval-batches 1"), 0) << stderr_;
  EXPECT_NE(stdout_.find("warning: --warmup-steps 50 is not shorter than this run's 40 steps"), std::string::npos)
      << stdout_;
  // A run of 1000 steps keeps the default (one step of it is enough to see).
  ASSERT_EQ(run(fmt::format("--batch-size 8 --steps 1000 --stop-after 1 --eval-batches 1 --metrics '{}'",
                            file("long.jsonl"))),
            0)
      << stderr_;
  EXPECT_EQ(stdout_.find("warm-up"), std::string::npos) << stdout_;
  EXPECT_EQ(events(file("long.jsonl"), "start").at(0)["warmup_steps"], 100);
}

// A loss-scaler study reads the scale and the skipped steps from every step
// event: under fp16 with a scale far too large, the steps back off until
// the gradients are finite and then grow every growth interval, exactly as
// the rule says; the start event holds the scaler's settings and the run's.
TEST_F(MptTrain, StepMetricsCarryTheScaleByTheScalersRule) {
  const int64_t interval = 3;
  ASSERT_EQ(run(fmt::format("--precision fp16 --init-scale 1099511627776 --growth-interval {} --batch-size 16 --steps "
                            "40 --log-every 1 --eval-batches 1 --metrics '{}'",
                            interval, file("m.jsonl"))),
            0)
      << stderr_;
  const auto start = events(file("m.jsonl"), "start").at(0);
  EXPECT_EQ(start["scaler"]["policy"], "dynamic");
  EXPECT_EQ(start["scaler"]["init_scale"], 1099511627776.0);
  EXPECT_EQ(start["scaler"]["growth_interval"], interval);
  for (const char* key : {"schedule", "warmup_steps", "weight_decay", "world_size", "resumed"})
    EXPECT_TRUE(start.contains(key)) << key;
  EXPECT_EQ(start["resumed"], false);
  const auto steps = events(file("m.jsonl"), "step");
  ASSERT_EQ(steps.size(), 40u);
  double scale = 1099511627776.0;
  int64_t skipped = 0, good_in_a_row = 0;
  for (const auto& s : steps) {
    const int64_t now_skipped = s.at("skipped_steps_in_run").get<int64_t>();
    ASSERT_TRUE(now_skipped == skipped || now_skipped == skipped + 1) << s.dump();
    if (now_skipped > skipped) {
      scale *= 0.5;
      good_in_a_row = 0;
    } else if (++good_in_a_row == interval) {
      scale *= 2;
      good_in_a_row = 0;
    }
    skipped = now_skipped;
    EXPECT_EQ(s.at("scale").get<double>(), scale) << s.dump();
  }
  EXPECT_GT(skipped, 5);       // it backed off from 2^40
  EXPECT_LT(skipped, 40);      // and then trained
}

TEST_F(MptTrain, GradientTransitNeedsDdp) {
  EXPECT_EQ(run("--steps 1 --grad-transit f16 --parallel none"), 1);
  EXPECT_NE(stderr_.find("--grad-transit f16 compresses DDP's all-reduces; it needs --parallel ddp (this run is none)"),
            std::string::npos)
      << stderr_;
}

}  // namespace
}  // namespace mpt
