#include "tools/mpt-scaler/sweep_training.h"

#include <algorithm>
#include <filesystem>

#include "models/adamw.h"
#include "models/data_loader.h"
#include "models/sampler.h"
#include "tensor/error.h"
#include "train/trainer.h"
#include "train/workload.h"

namespace mpt::tools {

std::string sweep_data(const SweepTrainingConfig& c) {
  if (!c.data.empty()) return c.data;
  return c.model == "gpt" ? "fortunes" : "fashion-mnist";
}

void check_sweep_data(const SweepTrainingConfig& c) {
  const std::string data = sweep_data(c);
  if (c.model == "gpt") {
    check<ValueError>(data == "fortunes" || std::filesystem::is_regular_file(data),
                      "mpt-scaler sweep: --model gpt trains on a text file or 'fortunes'; --data '{}' is neither",
                      data);
  } else {
    check<ValueError>(data == "fashion-mnist" || std::filesystem::is_directory(data),
                      "mpt-scaler sweep: --model {} trains on 'fashion-mnist' or a folder holding Fashion-MNIST's "
                      "four .gz files; --data '{}' is neither",
                      c.model, data);
  }
}

SweepTrainingResult train_for_sweep(const SweepTrainingConfig& c, const amp::GradScalerOptions& scaler,
                                    const amp::ScalerTraceSink& trace, const std::function<void(int64_t)>& on_step,
                                    const std::function<void(amp::Fp8Scaling&)>& on_fp8) {
  // mpt-train's workloads: the same models, data and loss.
  train::WorkloadOptions workload{.model = c.model, .data = sweep_data(c)};
  if (c.model == "gpt" && !c.device.is_cuda()) {
    workload.gpt_layers = 2;
    workload.gpt_heads = 4;
    workload.gpt_d_model = 128;
    workload.context = 64;
  }
  Generator init(c.seed);
  train::Workload w = train::make_workload(workload, init);
  w.model->to(c.device);
  w.model->named_parameters();  // names for the scaler's messages

  // The scaler under study runs whatever the autocast dtype (bf16 too),
  // and the step stays eager: the trace reads every update on the host.
  train::TrainerOptions options;
  options.step.precision = c.autocast_dtype == DType::bf16 ? train::Precision::bf16 : train::Precision::fp16;
  options.step.scaler = scaler;
  options.step.loss_scaling = train::LossScaling::always;
  if (c.fp8) {
    options.step.precision = train::Precision::fp8;
    options.step.fp8 = *c.fp8;
    options.step.loss_scaling = train::LossScaling::never;
  }
  options.step.cuda_graph = train::GraphMode::off;
  options.device = c.device;
  options.rng = &init;
  train::Trainer trainer(w.model, std::make_unique<optim::AdamW>(w.model->parameters(), optim::AdamWOptions{.lr = c.lr, .weight_decay = 0.0}),
                         w.objective, options);
  if (c.fp8) {
    if (on_fp8) on_fp8(*trainer.precision().fp8_scaling());
  } else {
    trainer.precision().scaler()->set_trace_sink(trace);
  }
  data::DataLoader loader(w.train_set, std::make_shared<data::SequentialOrRandomSampler>(w.train_set->size(), true, c.seed),
                          {.batch_size = c.batch, .num_workers = 1, .prefetch = 4,
                           .pin_memory = c.device.is_cuda()});

  // The final loss: the mean over the last tenth of the steps.
  const int64_t tail = std::max<int64_t>(1, c.steps / 10);
  double tail_loss = 0;
  train::FitOptions fit;
  fit.epochs = std::max<int64_t>(1, c.steps);  // as many as the steps take
  fit.max_steps = c.steps;
  fit.log_every = std::max<int64_t>(1, c.steps);
  train::FitCallbacks callbacks;
  callbacks.on_step = [&](int64_t step) {
    if (step > c.steps - tail) tail_loss += trainer.totals().step_loss();
    if (on_step) on_step(step);
  };
  trainer.fit(loader, fit, callbacks);
  return {tail_loss / static_cast<double>(tail), w.description};
}

}  // namespace mpt::tools
