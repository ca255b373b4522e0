#pragma once
// Everything a training run is told, as mpt-train's options set it.
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "tools/scaler_flags.h"

namespace mpt::tools {

struct TrainConfig {
  // What to train on what.
  std::string model = "mlp";            // mlp, cnn, gpt
  std::string data;                     // fashion-mnist, or a text file for gpt ("fortunes": the default corpus);
                                        // empty: the model's own (fashion-mnist; fortunes for gpt)
  int64_t context = 256;                // gpt: sequence length (and rows of the position table)
  int64_t gpt_layers = 6, gpt_heads = 6, gpt_d_model = 384;
  std::vector<int64_t> mlp_hidden = {1024, 1024};  // mlp: the hidden layers' widths (the reference's)
  int64_t sample_tokens = 200;          // gpt: characters sampled from the model after each epoch (0: none)
  std::string sample_prompt;            // gpt: the text the samples go on from (empty: the text's first character)
  double sample_temperature = 0.8;      // gpt: 0 takes the likeliest character each time
  int64_t sample_top_k = 0;             // gpt: draw among the k likeliest characters only (0: among all)

  // Numerics.
  std::string precision = "auto";       // fp16 (autocast + loss scaler), bf16 (autocast), fp32, fp8 (FP8
                                        // linear layers, bf16 elsewhere);
                                        // auto: fp16 on a GPU, bf16 on the CPU (no f16 arithmetic there)
  std::string fp8_recipe = "delayed";   // fp8: per-tensor scaling, delayed (amax history) or current
  int64_t fp8_history = 1024;           // fp8 delayed: amaxes kept per tensor
  double fp8_margin = 0;                // fp8: the scaled amax lands at the format's maximum / 2^margin
  std::string fp8_forward_accumulation = "fast";  // fp8: the forward products' accumulator, fast or f32
  std::string scaler = "dynamic";       // scaler policy (torch's is called dynamic here), with its settings:
  ScalerFlags scaler_flags;             // init scale, growth and backoff factors, growth interval
  double clip_grad_norm = 0;            // clip the gradients' global norm to this (0: no clipping)

  // Optimisation.
  int64_t batch_size = 0;               // 0: the model's default (mlp, cnn 128; gpt 64)
  int64_t accumulation = 1;             // micro-batches per optimizer step
  std::string optimizer = "adamw";      // adamw, sgd
  double lr = 1e-3, weight_decay = 0.0, momentum = 0.9;
  std::string schedule = "cosine";      // constant, cosine or linear (both after a linear warm-up)
  int64_t warmup_steps = 100;
  double min_lr_ratio = 0.0;            // cosine, linear: floor as a fraction of lr
  int64_t epochs = 2;
  int64_t max_steps = 0;                // stop after this many optimizer steps (0: run all epochs)
  int64_t stop_after = 0;               // end the run after this many steps as if interrupted
                                        // (the schedule still plans for all of them; 0: off)
  uint64_t seed = 0;

  // Where and how.
  std::string device = "auto";          // auto (a GPU if there is one, else the CPU), cpu, cuda, cuda:N
  std::string parallel = "auto";        // none, dp, ddp; auto: ddp under mpt-run, else none
  double dist_timeout = 60;             // ddp: seconds any rendezvous wait or collective may take
  std::string grad_transit = "f32";     // ddp: dtype of the gradient all-reduces (f32, f16, bf16)
  std::string cuda_graph = "auto";      // on, off; auto: on where the step can be captured
                                        // (CUDA, parallel none or ddp)
  int workers = 1;                      // data-loading threads
  int64_t eval_batches = 0;             // 0: the whole test set each epoch

  // Output.
  std::string checkpoint;               // path; empty: no checkpoints
  bool overwrite = false;               // a fresh run may replace an existing --checkpoint
  bool auto_resume = false;             // resume from --checkpoint when it exists, else start
  int64_t checkpoint_every = 0;         // steps between checkpoints (0: only at the end)
  std::string resume;                   // checkpoint to continue from
  std::string metrics;                  // JSON-lines file
  std::string progress = "auto";        // auto (bar on a terminal, lines otherwise), bar, lines, none
  int64_t log_every = 100;              // steps between plain progress lines

  // Which options (named as on the command line, without dashes) the
  // command line gave, and which are settled: given, or taken from the
  // checkpoint a run resumes (a default is neither).
  std::set<std::string> given, settled;
};

}  // namespace mpt::tools
