// Builds a small MLP, trains it for a few steps on a made-up task (is the
// sum of the inputs positive?) and saves a checkpoint that mpt-train and
// PyTorch's safetensors can read. Usage: train_mlp [checkpoint path]
#include <iostream>

#include "autograd/ops.h"
#include "models/adamw.h"
#include "models/checkpoint.h"
#include "models/mlp.h"

int main(int argc, char** argv) {
  const std::string path = argc > 1 ? argv[1] : "train_mlp.safetensors";
  try {
    mpt::Generator gen(42);
    const mpt::Device device = mpt::cuda_device_count() > 0 ? mpt::Device("cuda:0") : mpt::kCPU;
    auto model = mpt::nn::make_mlp({.in_features = 16, .hidden = {64}, .num_classes = 2}, &gen);
    model->to(device);
    mpt::optim::AdamW optimizer(model->parameters(), {.lr = 1e-2});

    double first_loss = 0, loss_value = 0;
    for (int step = 0; step < 50; ++step) {
      const mpt::Tensor x = mpt::randn({64, 16}, mpt::DType::f32, device, &gen);
      // Label 1 where the inputs sum to more than zero.
      const mpt::Tensor positive = mpt::prim::binary(mpt::BinaryOp::gt, mpt::prim::sum(x, {1}),
                                                     mpt::zeros({64}, mpt::DType::f32, device));
      const mpt::Tensor y = mpt::prim::to(positive, mpt::DType::i64);

      optimizer.zero_grad();
      const mpt::Tensor loss = mpt::cross_entropy(model->forward(x), y);
      mpt::backward(loss);
      optimizer.step();
      loss_value = loss.item();
      if (step == 0) first_loss = loss_value;
    }
    std::cout << "loss " << first_loss << " -> " << loss_value << " on " << device.str() << "\n";

    mpt::ckpt::save_checkpoint(path, mpt::ckpt::capture(*model, optimizer, 50, {}, gen));
    std::cout << "saved " << path << "\n";
    return loss_value < first_loss ? 0 : 1;
  } catch (const mpt::Error& e) {
    std::cerr << "train_mlp: " << e.what() << "\n";
    return 1;
  }
}
