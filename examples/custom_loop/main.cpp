// A training loop written by hand from mptrain's pieces, for programs that
// want that control: autocast, the loss scaler, and DDP with no_sync for
// gradient accumulation (what train::Trainer does for you, see
// examples/residual_mlp). A small MLP learns a made-up task (is the sum of
// the inputs positive?); alone, or with DDP under mpt-run (each rank its
// own batches, the gradients averaged). Rank 0 saves a checkpoint that
// mpt-train and PyTorch's safetensors can read.
//
//   custom_loop [checkpoint path]
//   mpt-run --nproc_per_node 2 custom_loop run.safetensors
#include <cstdlib>
#include <iostream>
#include <optional>

#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "autograd/engine.h"
#include "autograd/ops.h"
#include "models/adamw.h"
#include "models/checkpoint.h"
#include "models/mlp.h"
#include "parallel/device_routed_group.h"
#include "parallel/distributed_data_parallel.h"

using namespace mpt;

int main(int argc, char** argv) {
  const std::string path = argc > 1 ? argv[1] : "custom_loop.safetensors";
  try {
    std::optional<dist::Distributed> world;
    if (std::getenv("WORLD_SIZE") && std::atoi(std::getenv("WORLD_SIZE")) > 1) world = dist::init_process_group();
    const int rank = world ? world->config.rank : 0;
    const Device device = cuda_device_count() > 0 ? Device(DeviceType::cuda, world ? world->config.local_rank : 0) : kCPU;

    Generator gen(42);  // the same initial weights on every rank
    std::shared_ptr<nn::Module> model = nn::make_mlp({.in_features = 16, .hidden = {64}, .num_classes = 2}, &gen);
    model->to(device);
    std::optional<dist::DistributedDataParallel> ddp;
    if (world) ddp.emplace(model, world->group);
    optim::AdamW optimizer(model->parameters(), {.lr = 1e-2});
    // f16 on a GPU needs the loss scaler; bf16 on the CPU has f32's range.
    const DType half = device.is_cuda() ? DType::f16 : DType::bf16;
    amp::GradScaler scaler({.enabled = half == DType::f16});
    // Every rank skips or takes the same step.
    if (ddp) scaler.set_found_inf_reducer([&](Tensor& found_inf) { ddp->allreduce_found_inf(found_inf); });

    Generator data_gen(100 + rank);  // each rank its own batches
    constexpr int kMicroBatches = 2;
    double first_loss = 0, loss_value = 0;
    for (int step = 0; step < 60; ++step) {
      optimizer.zero_grad();
      loss_value = 0;
      for (int micro = 0; micro < kMicroBatches; ++micro) {
        const Tensor x = randn({32, 16}, DType::f32, device, &data_gen);
        // Label 1 where the inputs sum to more than zero.
        const Tensor y = prim::to(prim::binary(BinaryOp::gt, prim::sum(x, {1}), zeros({32}, DType::f32, device)),
                                  DType::i64);
        // Only the last micro-batch's backward all-reduces the gradients.
        std::optional<dist::DistributedDataParallel::NoSyncGuard> local_only;
        if (ddp && micro + 1 < kMicroBatches) local_only.emplace(*ddp);
        Tensor loss;
        {
          amp::AutocastGuard autocast(device.type, half);
          loss = cross_entropy(ddp ? ddp->forward(x) : model->forward(x), y);
        }
        backward(scaler.scale(loss * (1.0 / kMicroBatches)));
        loss_value += loss.item() / kMicroBatches;
      }
      scaler.step(optimizer);  // skipped when a gradient overflowed
      scaler.update();
      if (step == 0) first_loss = loss_value;
    }
    std::cout << "rank " << rank << ": loss " << first_loss << " -> " << loss_value << " on " << device.str() << "\n";

    if (rank == 0) {
      ckpt::Checkpoint snapshot = ckpt::capture(*model, optimizer, 60, {}, gen);
      for (const auto& [key, value] : scaler.state_dict()) snapshot.extra.insert("scaler." + key, scalar_tensor(value, DType::f64));
      ckpt::save_checkpoint(path, snapshot);
      std::cout << "saved " << path << "\n";
    }
    return loss_value < first_loss ? 0 : 1;
  } catch (const Error& e) {
    std::cerr << "custom_loop: " << e.what() << "\n";
    return 1;
  }
}
