#pragma once
// mpt-scaler fp8: real training under the FP8 recipes, once per (history
// length, margin) pair, tracing every FP8 tensor's amax, scale and the
// fractions of its elements that saturated or flushed to zero, step by step.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "amp/fp8_scaling.h"
#include "amp/scaler_plot.h"
#include "tools/mpt-scaler/sweep_training.h"

namespace mpt::tools {

// One FP8 tensor's trace: entry i is step i + 1's quantization (the last,
// where a step quantized it more than once).
struct Fp8SlotTrace {
  std::string name;  // "<layer>.input", "<layer>.weight", "<layer>.grad_output"
  std::vector<double> amax, scale, saturated, flushed;
};

struct Fp8LabRun {
  int64_t history_length = 0;
  double margin = 0;
  double final_loss = 0;
  std::vector<Fp8SlotTrace> slots;
};

// One run per history length and margin (histories outer), each from the
// same seed, weights and batches. on_step(run, step) after every step.
std::vector<Fp8LabRun> sweep_fp8(const SweepTrainingConfig& training, amp::Fp8ScalingMode scaling,
                                 amp::AmaxReduction reduction, const std::vector<int64_t>& histories,
                                 const std::vector<double>& margins,
                                 const std::function<void(size_t run, int64_t step)>& on_step);

// The run as JSON: its settings, final loss, and per tensor the mean
// saturated and flushed fractions and the four trajectories.
nlohmann::ordered_json fp8_run_json(const Fp8LabRun& run);

// The scale trajectory of the slot named `slot` in a run (ValueError
// naming the run's slots where there is none).
amp::ScaleSeries fp8_scale_series(const Fp8LabRun& run, const std::string& slot);

}  // namespace mpt::tools
