#include "tools/mpt-scaler/sweep_training.h"

#include <algorithm>
#include <filesystem>

#include "amp/autocast.h"
#include "autograd/engine.h"
#include "autograd/ops.h"
#include "models/adamw.h"
#include "models/data_loader.h"
#include "models/sampler.h"
#include "tensor/error.h"
#include "tools/mpt-train/train_config.h"
#include "tools/mpt-train/workload.h"

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

SweepTrainingResult train_for_sweep(const SweepTrainingConfig& c, amp::GradScaler& scaler,
                                    const std::function<void(int64_t)>& on_step) {
  // mpt-train's workloads: the same models, data and loss.
  train::TrainConfig tc;
  tc.model = c.model;
  tc.data = sweep_data(c);
  if (c.model == "gpt" && !c.device.is_cuda()) {
    tc.gpt_layers = 2;
    tc.gpt_heads = 4;
    tc.gpt_d_model = 128;
    tc.context = 64;
  }
  Generator init(c.seed);
  train::Workload w = train::make_workload(tc, init);
  w.model->to(c.device);
  w.model->named_parameters();  // names for the scaler's messages
  optim::AdamW opt(w.model->parameters(), {.lr = c.lr, .weight_decay = 0.0});
  data::DataLoader loader(w.train_set, std::make_shared<data::SequentialOrRandomSampler>(w.train_set->size(), true, c.seed),
                          {.batch_size = c.batch, .num_workers = 1, .prefetch = 4,
                           .pin_memory = c.device.is_cuda()});

  const int64_t tail = std::max<int64_t>(1, c.steps / 10);
  double tail_loss = 0;
  int64_t epoch = 0;
  loader.start_epoch(epoch);
  for (int64_t step = 0; step < c.steps; ++step) {
    std::optional<data::Batch> b = loader.next();
    if (!b) {
      loader.start_epoch(++epoch);
      b = loader.next();
    }
    const Tensor x = prim::to(b->input, c.device), y = prim::to(b->target, c.device);
    opt.zero_grad();
    Tensor loss;
    {
      amp::AutocastGuard autocast(c.device.type, c.autocast_dtype);
      loss = w.loss(w.forward(x), y);
    }
    backward(scaler.scale(loss, b->size()));
    scaler.step(opt);
    scaler.update();
    if (step >= c.steps - tail) tail_loss += loss.item();
    if (on_step) on_step(step + 1);
  }
  return {tail_loss / static_cast<double>(tail), w.description};
}

}  // namespace mpt::tools
