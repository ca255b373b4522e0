// mpt-parity: trains a reference model (the MLP, CNN or GPT-mini of
// ../shared/reference/torch_bench.py) from given initial weights on given
// batches, one batch a step, with AdamW, autocast and the loss scaler, and
// prints each step's loss and the loss scale after it as JSON lines; writes
// the final weights. scripts/parity_vs_torch.py gives PyTorch the same
// files and compares the two runs step by step.
//
//   mpt-parity --model mlp --init init.safetensors --data data.safetensors \
//              --precision fp16 --out final.safetensors
//
// The data file holds "x" and "y", each with the step as its first
// dimension: x [steps, batch, ...] (f32 features, or i64 tokens for gpt),
// y [steps, batch] (or [steps, batch, T] for gpt) of i64 classes.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cmath>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "autograd/ops.h"
#include "models/adamw.h"
#include "models/cnn.h"
#include "models/gpt.h"
#include "models/mlp.h"
#include "models/safetensors.h"
#include "tensor/backend_settings.h"
#include "tensor/device_guard.h"
#include "tensor/ops.h"
#include "tools/cli_checks.h"
#include "tools/scaler_flags.h"
#include "train/trainer.h"

using namespace mpt;

namespace {

struct Options {
  std::string model = "mlp";
  std::string init_path, data_path, out_path;
  std::string precision = "fp16";
  std::string device = "cuda:0";
  optim::AdamWOptions adamw{.lr = 1e-3};
  tools::ScalerFlags scaler;
  int64_t heads = 6;
  bool graph = false;
};

// The MLP whose Linear layers the file holds ("0.weight", "2.weight", ...,
// with a ReLU between each two), sized by their shapes.
std::shared_ptr<nn::Module> mlp_for(const OrderedDict<Tensor>& state) {
  std::vector<Shape> weights;
  for (int64_t i = 0; const Tensor* w = state.find(fmt::format("{}.weight", i)); i += 2) weights.push_back(w->shape());
  check(!weights.empty() && weights.front().size() == 2,
        "mpt-parity: the initial weights hold no MLP ('0.weight' of [out, in] is missing)");
  nn::MLPOptions o{.in_features = weights.front()[1], .hidden = {}, .num_classes = weights.back()[0]};
  for (size_t i = 0; i + 1 < weights.size(); ++i) o.hidden.push_back(weights[i][0]);
  return nn::make_mlp(o);
}

// GPT-mini sized by its tables and blocks; the heads are not in the weights.
std::shared_ptr<nn::Module> gpt_for(const OrderedDict<Tensor>& state, int64_t heads) {
  const Tensor* tok = state.find("tok.weight");
  const Tensor* pos = state.find("pos.weight");
  check(tok && pos && tok->dim() == 2 && pos->dim() == 2,
        "mpt-parity: the initial weights hold no GPT ('tok.weight' and 'pos.weight' are missing)");
  nn::GPTOptions o{.vocab_size = tok->shape()[0], .context = pos->shape()[0], .d_model = tok->shape()[1],
                   .n_layers = 0, .n_heads = heads};
  while (state.contains(fmt::format("blocks.{}.ln1.weight", o.n_layers))) ++o.n_layers;
  return std::make_shared<nn::GPT>(o);
}

std::shared_ptr<nn::Module> model_for(const Options& o, const OrderedDict<Tensor>& state) {
  if (o.model == "mlp") return mlp_for(state);
  if (o.model == "gpt") return gpt_for(state, o.heads);
  return nn::make_cnn();
}

// Step `s`'s slice of a [steps, ...] tensor.
Tensor at_step(const Tensor& t, int64_t s) { return squeeze(slice(t, 0, s, s + 1), 0); }

int run(const Options& o) {
  const Device device(o.device);
  DeviceGuard on_device(device);
  // f32 means f32 on both sides (PyTorch is told so too: its cuDNN
  // convolutions would use TF32 by default).
  if (device.is_cuda()) set_allow_tf32(false);

  const io::TensorFile init = io::load_safetensors(o.init_path);
  const io::TensorFile data = io::load_safetensors(o.data_path);
  const Tensor* x = data.tensors.find("x");
  const Tensor* y = data.tensors.find("y");
  check(x && y && x->dim() >= 2 && y->dim() >= 2 && x->shape()[0] == y->shape()[0],
        "mpt-parity: {} must hold x [steps, batch, ...] and y [steps, batch, ...] with as many steps", o.data_path);
  const Tensor xs = prim::to(*x, device), ys = prim::to(*y, device);

  std::shared_ptr<nn::Module> model = model_for(o, init.tensors);
  model->load_state_dict(init.tensors, /*strict=*/true);
  model->to(device);
  train::TrainerOptions options;
  options.step.precision = train::precision_from_name(o.precision);
  options.step.scaler = o.scaler.checked(amp::ScalePolicy::torch, "mpt-parity");
  options.step.cuda_graph = o.graph ? train::GraphMode::automatic : train::GraphMode::off;
  options.device = device;
  train::Trainer trainer(model, std::make_unique<optim::AdamW>(model->parameters(), o.adamw),
                         train::classification(), options);
  const int64_t steps = xs.shape()[0];
  for (int64_t s = 0; s < steps; ++s) {
    trainer.step({data::Batch{at_step(xs, s), at_step(ys, s)}});
    std::cout << fmt::format("{{\"step\": {}, \"loss\": {:.9g}, \"scale\": {:.9g}}}\n", s,
                             trainer.totals().step_loss(), trainer.precision().scale());
  }
  if (o.graph && !trainer.graph())
    std::cerr << "mpt-parity: the step could not be captured: " << trainer.graph_obstacle() << "\n";
  else if (o.graph && trainer.graph_replays() == 0)
    std::cerr << "mpt-parity: the step could not be captured: " << trainer.graph_fallback_reason() << "\n";
  io::save_safetensors(o.out_path, model->state_dict());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  using mpt::tools::non_negative;
  using mpt::tools::positive;
  Options o;
  CLI::App app{"mpt-parity: trains a reference model from given weights on given batches and prints each step's "
               "loss and loss scale (the mptrain side of scripts/parity_vs_torch.py)"};
  app.option_defaults()->always_capture_default();
  app.add_option("--model", o.model, "mlp, cnn or gpt (the layouts of torch_bench.py)")
      ->check(CLI::IsMember({"mlp", "cnn", "gpt"}));
  app.add_option("--init", o.init_path, "safetensors file of the initial weights, named as the model names them")
      ->required();
  app.add_option("--data", o.data_path, "safetensors file with x [steps, batch, ...] and y [steps, batch, ...]")
      ->required();
  app.add_option("--out", o.out_path, "where to write the final weights (safetensors)")->required();
  app.add_option("--precision", o.precision, "fp16 (autocast + loss scaler), bf16 (autocast) or fp32")
      ->check(CLI::IsMember({"fp16", "bf16", "fp32"}));
  app.add_option("--device", o.device, "cuda:N or cpu");
  app.add_option("--lr", o.adamw.lr, "AdamW's learning rate")->check(positive());
  app.add_option("--weight-decay", o.adamw.weight_decay, "AdamW's decoupled weight decay")->check(non_negative());
  o.scaler.add_to(app);
  app.add_option("--heads", o.heads, "gpt: attention heads")->check(positive());
  app.add_flag("--graph", o.graph, "replay each step as a CUDA graph after its eager first steps");
  if (const auto status = mpt::tools::parse_command_line(app, argc, argv)) return *status;
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::cerr << "mpt-parity: " << e.what() << "\n";
    return 1;
  }
}
