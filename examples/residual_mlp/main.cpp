// A model of your own trained with mptrain's step API (train::Trainer): a
// residual MLP on Fashion-MNIST, in bf16 autocast on the CPU or fp16 with
// the loss scaler on a GPU, with a checkpoint. Run again with the same
// checkpoint, it resumes where the last run stopped and ends as one
// unbroken run would. Started by mpt-run, every rank trains its shard of
// the data with DDP (Gloo on the CPU, NCCL on GPUs).
//
//   residual_mlp run.safetensors [--steps N] [--stop-after N] [--data DIR]
//   mpt-run --nproc_per_node 2 residual_mlp run.safetensors
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "autograd/ops.h"
#include "models/adamw.h"
#include "models/data_loader.h"
#include "models/fashion_mnist.h"
#include "models/layers.h"
#include "models/lr_schedule.h"
#include "models/sampler.h"
#include "parallel/device_routed_group.h"
#include "train/trainer.h"

using namespace mpt;

// x + fc2(relu(fc1(norm(x)))): a block that learns a correction to its input.
class ResidualBlock : public nn::Module {
 public:
  ResidualBlock(int64_t width, Generator& gen) : nn::Module("ResidualBlock") {
    norm_ = register_module("norm", std::make_shared<nn::LayerNorm>(width));
    fc1_ = register_module("fc1", std::make_shared<nn::Linear>(width, 2 * width, true, &gen));
    fc2_ = register_module("fc2", std::make_shared<nn::Linear>(2 * width, width, true, &gen));
  }
  Tensor forward(const Tensor& x) override { return x + fc2_->forward(relu(fc1_->forward(norm_->forward(x)))); }

 private:
  std::shared_ptr<nn::LayerNorm> norm_;
  std::shared_ptr<nn::Linear> fc1_, fc2_;
};

// Images [N, 1, 28, 28] -> a width-wide embedding -> residual blocks -> class scores.
class ResidualMLP : public nn::Module {
 public:
  ResidualMLP(int64_t width, int blocks, Generator& gen) : nn::Module("ResidualMLP") {
    embed_ = register_module("embed", std::make_shared<nn::Linear>(28 * 28, width, true, &gen));
    for (int i = 0; i < blocks; ++i)
      blocks_.push_back(register_module("block" + std::to_string(i), std::make_shared<ResidualBlock>(width, gen)));
    head_ = register_module("head", std::make_shared<nn::Linear>(width, 10, true, &gen));
  }
  Tensor forward(const Tensor& images) override {
    Tensor h = embed_->forward(flatten(images, 1));
    for (const auto& block : blocks_) h = block->forward(h);
    return head_->forward(h);
  }

 private:
  std::shared_ptr<nn::Linear> embed_, head_;
  std::vector<std::shared_ptr<ResidualBlock>> blocks_;
};

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: residual_mlp CHECKPOINT [--steps N] [--stop-after N] [--data DIR]\n";
    return 2;
  }
  const std::string checkpoint = argv[1];
  int64_t steps = 300, stop_after = 0;
  std::string data_dir = data::kFashionMnistDir;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--steps") steps = std::atoll(argv[i + 1]);
    else if (flag == "--stop-after") stop_after = std::atoll(argv[i + 1]);
    else if (flag == "--data") data_dir = argv[i + 1];
  }
  try {
    // Under mpt-run (or torchrun) every rank joins the job; alone, it trains by itself.
    std::optional<dist::Distributed> world;
    if (std::getenv("WORLD_SIZE") && std::atoi(std::getenv("WORLD_SIZE")) > 1) world = dist::init_process_group();
    const int rank = world ? world->config.rank : 0, ranks = world ? world->config.world_size : 1;
    const Device device = cuda_device_count() > 0 ? Device(DeviceType::cuda, world ? world->config.local_rank : 0) : kCPU;

    Generator gen(7);  // the same initial weights on every rank
    auto model = std::make_shared<ResidualMLP>(256, 2, gen);
    model->to(device);
    auto train_set = std::make_shared<data::FashionMNIST>(data::Split::train, data_dir);
    const data::FashionMNIST test_set(data::Split::test, data_dir);
    data::DataLoader loader(train_set,
                            std::make_shared<data::DistributedSampler>(train_set->size(), ranks, rank, true, 7),
                            {.batch_size = 64, .num_workers = 1});

    train::TrainerOptions options;
    options.step.precision = train::default_precision(device);  // bf16 on the CPU, fp16 (with the scaler) on a GPU
    options.step.max_grad_norm = 1.0;
    options.device = device;
    if (world) {
      options.parallel = train::Parallel::ddp;
      options.group = world->group;
    }
    options.schedule = optim::LrSchedule::cosine(2e-3, steps / 10, steps);
    options.rng = &gen;
    train::Trainer trainer(model, std::make_unique<optim::AdamW>(model->parameters(), optim::AdamWOptions{.lr = 2e-3}),
                           train::classification(), options);

    // A checkpoint of this run: go on from it.
    if (std::filesystem::exists(checkpoint)) {
      trainer.restore(ckpt::read_checkpoint(checkpoint), checkpoint);
      if (rank == 0) std::cout << "resumed from " << checkpoint << " at step " << trainer.steps() << "\n";
    }
    train::FitOptions fit{.epochs = 100, .max_steps = steps, .stop_after = stop_after, .log_every = 50,
                          .checkpoint = checkpoint};
    train::FitCallbacks callbacks;
    callbacks.on_log = [&](const train::StepMetrics& m) {
      if (rank == 0)
        std::cout << "step " << m.step << ": loss " << m.loss << ", lr " << m.lr << ", scale " << m.scale
                  << ", skipped " << m.skipped_steps << ", " << m.timing.total_ms() << " ms/step\n";
    };
    const train::FitResult result = trainer.fit(loader, fit, callbacks);
    const train::Evaluation eval = trainer.evaluate(test_set, 500, 4);
    if (rank == 0)
      std::cout << (result.finished ? "done" : "stopped") << " after step " << result.steps << " of "
                << result.total_steps << " on " << device.str() << " (" << train::precision_name(options.step.precision)
                << ", " << ranks << " rank" << (ranks > 1 ? "s" : "") << "): test loss " << eval.loss
                << ", test accuracy " << eval.accuracy << "\n";
    return 0;
  } catch (const Error& e) {
    std::cerr << "residual_mlp: " << e.what() << "\n";
    return 1;
  }
}
