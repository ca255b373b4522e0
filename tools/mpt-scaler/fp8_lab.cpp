#include "tools/mpt-scaler/fp8_lab.h"

#include <algorithm>
#include <numeric>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "amp/fp8_stats.h"
#include "tensor/error.h"

namespace mpt::tools {
namespace {

double mean(const std::vector<double>& v) {
  return v.empty() ? 0.0 : std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

void put(std::vector<double>& v, int64_t step, double value) {
  if (static_cast<int64_t>(v.size()) < step) v.resize(static_cast<size_t>(step), 0.0);
  v[static_cast<size_t>(step - 1)] = value;
}

}  // namespace

std::vector<Fp8LabRun> sweep_fp8(const SweepTrainingConfig& training, amp::Fp8ScalingMode scaling,
                                 amp::AmaxReduction reduction, const std::vector<int64_t>& histories,
                                 const std::vector<double>& margins,
                                 const std::function<void(size_t run, int64_t step)>& on_step) {
  std::vector<Fp8LabRun> runs;
  for (int64_t history : histories)
    for (double margin : margins) {
      SweepTrainingConfig c = training;
      c.fp8 = amp::Fp8Recipe{scaling, history, reduction, static_cast<float>(margin)};
      Fp8LabRun run;
      run.history_length = history;
      run.margin = margin;
      int64_t step = 1;  // the step being taken
      std::vector<Fp8SlotTrace> traces[2];
      auto observe = [&](amp::Fp8Scaling& state) {
        for (amp::Fp8Group g : {amp::Fp8Group::forward, amp::Fp8Group::backward}) {
          traces[static_cast<int>(g)].resize(static_cast<size_t>(state.slots(g)));
          for (int64_t s = 0; s < state.slots(g); ++s) traces[static_cast<int>(g)][s].name = state.slot_name(g, s);
        }
        state.set_observer([&](amp::Fp8Group g, int64_t slot, const Tensor& in, const Tensor& scale) {
          const amp::Fp8QuantizationStats st = amp::fp8_quantization_stats(in, scale, amp::fp8_format(g));
          Fp8SlotTrace& t = traces[static_cast<int>(g)][static_cast<size_t>(slot)];
          put(t.amax, step, st.amax);
          put(t.scale, step, st.scale);
          put(t.saturated, step, st.saturated);
          put(t.flushed, step, st.flushed);
        });
      };
      const size_t index = runs.size();
      const SweepTrainingResult result = train_for_sweep(
          c, amp::GradScalerOptions{}, amp::ScalerTraceSink{},
          [&](int64_t done) {
            step = done + 1;
            if (on_step) on_step(index, done);
          },
          observe);
      run.final_loss = result.final_loss;
      for (auto& group : traces)
        for (auto& t : group) run.slots.push_back(std::move(t));
      runs.push_back(std::move(run));
    }
  return runs;
}

nlohmann::ordered_json fp8_run_json(const Fp8LabRun& run) {
  nlohmann::ordered_json slots = nlohmann::ordered_json::array();
  for (const Fp8SlotTrace& t : run.slots)
    slots.push_back({{"name", t.name},
                     {"mean_saturated", mean(t.saturated)},
                     {"mean_flushed", mean(t.flushed)},
                     {"amax", t.amax},
                     {"scale", t.scale},
                     {"saturated", t.saturated},
                     {"flushed", t.flushed}});
  return {{"history_length", run.history_length},
          {"margin", run.margin},
          {"final_loss", run.final_loss},
          {"tensors", std::move(slots)}};
}

amp::ScaleSeries fp8_scale_series(const Fp8LabRun& run, const std::string& slot) {
  const auto it = std::find_if(run.slots.begin(), run.slots.end(), [&](const Fp8SlotTrace& t) { return t.name == slot; });
  if (it == run.slots.end()) {
    std::vector<std::string> names;
    for (const Fp8SlotTrace& t : run.slots) names.push_back(t.name);
    throw ValueError(fmt::format("mpt-scaler fp8: no FP8 tensor named '{}' (the run's: {})", slot, fmt::join(names, ", ")));
  }
  amp::ScaleSeries s;
  s.label = fmt::format("history {}, margin {}", run.history_length, run.margin);
  for (size_t i = 0; i < it->scale.size(); ++i) {
    s.steps.push_back(static_cast<double>(i + 1));
    s.scales.push_back(it->scale[i]);
  }
  return s;
}

}  // namespace mpt::tools
