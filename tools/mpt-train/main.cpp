// mpt-train: trains a reference model. With no arguments: the MLP on
// Fashion-MNIST on the best device found; see --help for everything else.
#include <CLI/CLI.hpp>

#include <exception>

#include "models/gpt.h"
#include "tensor/error.h"
#include "tools/cli_checks.h"
#include "tools/mpt-train/run_settings.h"
#include "tools/mpt-train/trainer.h"

int main(int argc, char** argv) {
  using mpt::tools::non_negative;
  using mpt::tools::positive;
  mpt::tools::TrainConfig c;
  CLI::App app{"mpt-train: train a reference model (MLP, CNN, GPT-mini) with mptrain"};
  app.option_defaults()->always_capture_default();

  app.add_option("--model", c.model, "Model")->check(CLI::IsMember({"mlp", "cnn", "gpt"}));
  app.add_option("--data", c.data,
                 "Data: for mlp and cnn fashion-mnist (their default: Debian's copy) or a folder holding "
                 "Fashion-MNIST's four .gz files; for gpt a text file, or 'fortunes' (its default corpus)");
  std::string gpt_preset = "mini";
  app.add_option("--gpt-preset", gpt_preset,
                 "gpt: sizes to start from: mini (6 layers, 6 heads, d 384, context 256) or gpt2 (GPT-2 small's: 12 "
                 "layers, 12 heads, d 768, context 1024); --context and --gpt-* given beside it win")
      ->check(CLI::IsMember({"mini", "gpt2"}));
  app.add_option("--context", c.context, "gpt: sequence length")->check(positive());
  app.add_option("--gpt-layers", c.gpt_layers, "gpt: number of blocks")->check(positive());
  app.add_option("--gpt-heads", c.gpt_heads, "gpt: attention heads")->check(positive());
  app.add_option("--gpt-d-model", c.gpt_d_model, "gpt: model width")->check(positive());
  app.add_option("--mlp-hidden", c.mlp_hidden,
                 "mlp: the hidden layers' widths, e.g. 8192,8192,8192 (the default is the reference's 1024,1024)")
      ->delimiter(',')
      ->check(positive());
  app.add_option("--sample-tokens", c.sample_tokens,
                 "gpt: characters of text sampled from the model after each epoch (0: none)")
      ->check(non_negative());
  app.add_option("--sample-prompt", c.sample_prompt,
                 "gpt: the text the samples go on from (empty: the training text's first character)");
  app.add_option("--sample-temperature", c.sample_temperature,
                 "gpt: sampling temperature (0: the likeliest character each time)")
      ->check(non_negative());
  app.add_option("--sample-top-k", c.sample_top_k, "gpt: draw among the k likeliest characters only (0: among all)")
      ->check(non_negative());

  app.add_option("--precision", c.precision,
                 "fp16 (autocast + loss scaler), bf16 (autocast), fp32, fp8 (linear layers in FP8 but the output "
                 "head, bf16 autocast elsewhere), or auto (fp16 on a GPU, bf16 on the CPU)")
      ->check(CLI::IsMember({"auto", "fp16", "bf16", "fp32", "fp8"}));
  app.add_option("--fp8-recipe", c.fp8_recipe,
                 "fp8: per-tensor scaling from an amax history (delayed, Transformer Engine's) or from each "
                 "tensor's own amax (current)")
      ->check(CLI::IsMember({"delayed", "current"}));
  app.add_option("--fp8-history", c.fp8_history, "fp8 delayed: amaxes kept per tensor (the scale uses their maximum)")
      ->check(positive());
  app.add_option("--fp8-margin", c.fp8_margin,
                 "fp8: scale each tensor's amax to the format's maximum / 2^margin (headroom for growth)");
  app.add_option("--fp8-forward-accumulation", c.fp8_forward_accumulation,
                 "fp8: the forward products sum in the FP8 tensor cores' own accumulator (fast) or promote to f32 "
                 "as the backward's do (f32; slower). The CPU's products are f32 either way")
      ->check(CLI::IsMember({"fast", "f32"}));
  // The loss scaler runs with fp16 only; its options are checked in every run.
  app.add_option("--scaler", c.scaler,
                 "Loss-scaler policy for fp16: dynamic (PyTorch's; also called torch), hysteresis, static")
      ->check(CLI::IsMember({"dynamic", "torch", "hysteresis", "static"}));
  c.scaler_flags.add_to(app);
  app.add_option("--clip-grad-norm", c.clip_grad_norm,
                 "Clip the gradients' global 2-norm to this before each optimizer step (after unscaling; 0: no "
                 "clipping)")
      ->check(non_negative());

  app.add_option("--batch-size", c.batch_size, "Samples per micro-batch (0: the model's default, 128 or 64 for gpt)")
      ->check(non_negative());
  app.add_option("--accumulation", c.accumulation, "Micro-batches per optimizer step")->check(positive());
  app.add_option("--optimizer", c.optimizer, "Optimizer")->check(CLI::IsMember({"adamw", "sgd"}));
  app.add_option("--lr", c.lr, "Peak learning rate")->check(non_negative());
  app.add_option("--weight-decay", c.weight_decay, "Weight decay")->check(non_negative());
  app.add_option("--momentum", c.momentum, "SGD momentum")->check(non_negative());
  app.add_option("--schedule", c.schedule, "Learning-rate schedule")->check(CLI::IsMember({"constant", "cosine", "linear"}));
  app.add_option("--warmup-steps", c.warmup_steps, "cosine, linear: warm-up steps")->check(non_negative());
  app.add_option("--min-lr-ratio", c.min_lr_ratio, "cosine, linear: final lr as a fraction of --lr")
      ->check(mpt::tools::fraction());
  app.add_option("--epochs", c.epochs, "Epochs")->check(positive());
  app.add_option("--steps", c.max_steps, "Stop after this many optimizer steps (0: all epochs)")
      ->check(non_negative());
  app.add_option("--stop-after", c.stop_after,
                 "End after this many steps (counted from the start of the run), checkpointing as if interrupted, "
                 "with exit status 0; --resume continues the same run (0: off)")
      ->check(non_negative());
  app.add_option("--seed", c.seed, "Seed of the weights and the data order");

  app.add_option("--device", c.device,
                 "auto (a GPU if present, else the CPU), cpu, cuda, cuda:N; under ddp, auto and cuda mean the GPU of "
                 "LOCAL_RANK");
  app.add_option("--parallel", c.parallel,
                 "none, dp, ddp; auto: ddp when started as one of several processes (by mpt-run or torchrun, "
                 "Open MPI's mpirun or Slurm's srun)")
      ->check(CLI::IsMember({"auto", "none", "dp", "ddp"}));
  app.add_option("--dist-timeout", c.dist_timeout,
                 "ddp: seconds a rendezvous wait or a collective may take before the rank fails (a dead peer is "
                 "noticed at once; this bounds a silent one)")
      ->check(positive());
  app.add_option("--grad-transit", c.grad_transit,
                 "ddp: dtype gradients are all-reduced in: f32, or f16 / bf16 (half the traffic, rounded once; an "
                 "f16 overflow is an inf the loss scaler skips)")
      ->check(CLI::IsMember({"f32", "f16", "bf16"}));
  app.add_option("--cuda-graph", c.cuda_graph,
                 "Record the training step once as a CUDA graph and replay it (one launch per step): on, off; "
                 "auto: on where it can be (a GPU, --parallel none or ddp)")
      ->check(CLI::IsMember({"auto", "on", "off"}));
  app.add_option("--workers", c.workers, "Data-loading threads (0: load in the training thread)")
      ->check(non_negative());
  app.add_option("--eval-batches", c.eval_batches,
                 "Batches evaluated per epoch (0: the whole test set or held-out text)")
      ->check(non_negative());

  auto* checkpoint = app.add_option("--checkpoint", c.checkpoint,
                 "Checkpoint file (safetensors), written at the end; a run that does not resume it refuses to "
                 "replace an existing one unless given --overwrite");
  app.add_option("--checkpoint-every", c.checkpoint_every, "Also write it every N steps (0: only at the end)")
      ->check(non_negative());
  auto* resume = app.add_option("--resume", c.resume,
                                "Continue the run of this checkpoint, with the options it recorded (options given "
                                "again must agree, except those that may change: --steps, --epochs, --progress, ...)");
  auto* auto_resume = app.add_flag("--auto-resume", c.auto_resume,
                                   "Continue from --checkpoint when that file exists, else start (for jobs that are "
                                   "requeued or restart themselves)");
  auto_resume->excludes(resume)->needs(checkpoint);
  app.add_flag("--overwrite", c.overwrite, "Let a run that does not resume --checkpoint replace that file");
  app.add_option("--metrics", c.metrics, "Append metrics as JSON lines to this file");
  app.add_option("--progress", c.progress, "auto (a bar on a terminal, else lines), bar, lines, none")
      ->check(CLI::IsMember({"auto", "bar", "lines", "none"}));
  app.add_option("--log-every", c.log_every, "Steps between progress lines and step metrics")->check(positive());

  if (const auto status = mpt::tools::parse_command_line(app, argc, argv)) return *status;
  if (gpt_preset == "gpt2") {
    const mpt::nn::GPTOptions gpt2 = mpt::nn::gpt2_small_options();  // its vocabulary is the text's characters here
    if (!app.count("--context")) c.context = gpt2.context;
    if (!app.count("--gpt-layers")) c.gpt_layers = gpt2.n_layers;
    if (!app.count("--gpt-heads")) c.gpt_heads = gpt2.n_heads;
    if (!app.count("--gpt-d-model")) c.gpt_d_model = gpt2.d_model;
  }
  // Every option of the run's table is one of the command line's
  // (get_option throws for a name that is not).
  mpt::tools::for_each_option(c, [&](const char* name, auto&, mpt::tools::OnResume, bool) {
    if (app.get_option(fmt::format("--{}", name))->count() > 0) c.given.insert(name);
  });
  c.settled = c.given;
  try {
    mpt::tools::check_options(c);
  } catch (const mpt::ValueError& e) {
    fmt::print(stderr, "{}\n", e.what());
    return mpt::tools::kUsageError;
  }
  try {
    if (mpt::tools::run_training(c).interrupted) return 130;  // as a shell reports death by SIGINT
  } catch (const std::exception& e) {
    // mpt::Error, or what the standard library throws (std::filesystem, std::bad_alloc).
    const std::string message = e.what();
    fmt::print(stderr, "{}{}\n", message.starts_with("mpt-train:") ? "" : "mpt-train: ", message);
    return 1;
  }
  return 0;
}
