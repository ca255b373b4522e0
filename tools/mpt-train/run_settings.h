#pragma once
// mpt-train's options as one table: each option's command-line name, the
// TrainConfig field it sets, what a resumed run does with it, and whether
// the ranks of a job must agree on it. From the table, a checkpoint records
// the run's whole configuration, `--resume X` alone continues the run it
// holds, and the ranks compare their settings before they train.
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "parallel/settings_check.h"
#include "tools/mpt-train/train_config.h"

namespace mpt::tools {

enum class OnResume {
  fixed,      // what the run is (its model, numbers, batches): given again, it must agree with the checkpoint
  kept,       // taken from the checkpoint unless given again, when it may change (--steps, --lr, --progress, ...;
              // the schedule is planned again)
  not_saved,  // this invocation's alone (--resume, --stop-after, --overwrite)
};

// Calls visit(name, field, on_resume, same_on_every_rank) for every option,
// `name` as on the command line without its dashes.
template <typename Config, typename Visit>
void for_each_option(Config& c, Visit&& visit) {
  using R = OnResume;
  constexpr bool every_rank = true, any = false;
  visit("model", c.model, R::fixed, every_rank);
  visit("data", c.data, R::kept, any);  // a path: its content is compared instead
  visit("context", c.context, R::fixed, every_rank);
  visit("gpt-layers", c.gpt_layers, R::fixed, every_rank);
  visit("gpt-heads", c.gpt_heads, R::fixed, every_rank);
  visit("gpt-d-model", c.gpt_d_model, R::fixed, every_rank);
  visit("mlp-hidden", c.mlp_hidden, R::fixed, every_rank);
  visit("sample-tokens", c.sample_tokens, R::kept, any);
  visit("sample-prompt", c.sample_prompt, R::kept, any);
  visit("sample-temperature", c.sample_temperature, R::kept, any);
  visit("sample-top-k", c.sample_top_k, R::kept, any);
  visit("precision", c.precision, R::fixed, every_rank);
  visit("fp8-recipe", c.fp8_recipe, R::fixed, every_rank);
  visit("fp8-history", c.fp8_history, R::fixed, every_rank);
  visit("fp8-margin", c.fp8_margin, R::fixed, every_rank);
  visit("fp8-forward-accumulation", c.fp8_forward_accumulation, R::fixed, every_rank);
  visit("scaler", c.scaler, R::fixed, every_rank);
  visit("init-scale", c.scaler_flags.options.init_scale, R::fixed, every_rank);
  visit("growth-factor", c.scaler_flags.options.growth_factor, R::fixed, every_rank);
  visit("backoff-factor", c.scaler_flags.options.backoff_factor, R::fixed, every_rank);
  visit("growth-interval", c.scaler_flags.options.growth_interval, R::fixed, every_rank);
  visit("clip-grad-norm", c.clip_grad_norm, R::fixed, every_rank);
  visit("batch-size", c.batch_size, R::fixed, every_rank);
  visit("accumulation", c.accumulation, R::fixed, every_rank);
  visit("optimizer", c.optimizer, R::fixed, every_rank);
  visit("lr", c.lr, R::kept, every_rank);
  visit("weight-decay", c.weight_decay, R::fixed, every_rank);
  visit("momentum", c.momentum, R::fixed, every_rank);
  visit("schedule", c.schedule, R::kept, every_rank);
  visit("warmup-steps", c.warmup_steps, R::kept, every_rank);
  visit("min-lr-ratio", c.min_lr_ratio, R::kept, every_rank);
  visit("epochs", c.epochs, R::kept, every_rank);
  visit("steps", c.max_steps, R::kept, every_rank);
  visit("stop-after", c.stop_after, R::not_saved, every_rank);
  visit("seed", c.seed, R::fixed, every_rank);
  visit("device", c.device, R::kept, any);
  visit("parallel", c.parallel, R::kept, every_rank);
  visit("dist-timeout", c.dist_timeout, R::kept, any);
  visit("grad-transit", c.grad_transit, R::fixed, every_rank);
  visit("cuda-graph", c.cuda_graph, R::kept, every_rank);
  visit("workers", c.workers, R::kept, any);
  visit("eval-batches", c.eval_batches, R::kept, any);
  visit("checkpoint", c.checkpoint, R::kept, any);
  visit("checkpoint-every", c.checkpoint_every, R::kept, any);
  visit("resume", c.resume, R::not_saved, any);
  visit("metrics", c.metrics, R::kept, any);
  visit("progress", c.progress, R::kept, any);
  visit("log-every", c.log_every, R::kept, every_rank);  // the ranks share their step times at logging steps
}

// The saved part of the configuration (fixed and kept options), as the
// checkpoint's "run.config" records it.
nlohmann::ordered_json saved_options(const TrainConfig& c);

// --resume: the checkpoint's options for every one this run did not give
// (`c.given`), each added to `c.settled`. Options it lacks keep their
// defaults (a checkpoint of an older mptrain).
void take_saved_options(TrainConfig& c, const nlohmann::json& saved);

// After the defaults are resolved: every fixed option this run gave must
// equal the checkpoint's; ValueError naming the first that differs, both
// values, and the options that may change.
void check_fixed_options(const TrainConfig& c, const nlohmann::json& saved, const std::string& source);

// The options the ranks of a job must share, by name ("--batch-size"), as
// this run resolved them.
dist::Settings rank_settings(const TrainConfig& c);

// "--steps, --epochs, ...": the options a resumed run may change.
std::string options_that_may_change();

}  // namespace mpt::tools
