#pragma once
// The training run a growth-interval sweep repeats: one of the reference
// models on its real data (the MLP or CNN on Fashion-MNIST, GPT-mini on the
// fortunes text), with autocast and the scaler under study. Same seed, same
// initial weights and batch order in every run, so runs differ only in the
// scaler.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "amp/fp8_scaling.h"
#include "amp/grad_scaler.h"
#include "tensor/device.h"
#include "tensor/dtype.h"

namespace mpt::tools {

struct SweepTrainingConfig {
  std::string model = "mlp";  // mlp, cnn, gpt
  // As mpt-train's --data: for mlp and cnn "fashion-mnist" (Debian's copy)
  // or a folder holding Fashion-MNIST's four .gz files; for gpt a text file
  // or "fortunes" (Debian's fortunes). Empty: the model's own (fashion-mnist;
  // fortunes for gpt).
  std::string data;
  int64_t steps = 500;
  int64_t batch = 64;
  double lr = 1e-3;
  Device device = kCPU;
  DType autocast_dtype = DType::f16;
  // Set: an fp8 run (train::Precision::fp8 with this recipe, no loss
  // scaler) instead of the scaler's.
  std::optional<amp::Fp8Recipe> fp8;
  uint64_t seed = 0;
  // gpt: the reference GPT-mini on a GPU; on the CPU a 2-layer, d 128,
  // context 64 version of it, so a sweep of several runs stays short.
};

// The data a run trains on: config.data, or the model's own where that is empty.
std::string sweep_data(const SweepTrainingConfig& config);

// ValueError naming --data where the model cannot train on it (a missing
// file or folder, text for mlp), so that a sweep refuses it before any run.
void check_sweep_data(const SweepTrainingConfig& config);

struct SweepTrainingResult {
  double final_loss = 0;  // the mean loss over the last 10% of steps (f32)
  std::string workload;   // the model and data trained ("gpt (...) on 'notes.txt' (...)")
};

// Trains once (with train::Trainer) under a loss scaler of `scaler`'s
// options, its trace going to `trace` (fp8 runs: neither). on_step (if
// set) is called after each step with the steps done; on_fp8 (fp8 runs)
// once before the first, with the run's FP8 scaling state.
SweepTrainingResult train_for_sweep(const SweepTrainingConfig& config, const amp::GradScalerOptions& scaler,
                                    const amp::ScalerTraceSink& trace,
                                    const std::function<void(int64_t)>& on_step = {},
                                    const std::function<void(amp::Fp8Scaling&)>& on_fp8 = {});

}  // namespace mpt::tools
