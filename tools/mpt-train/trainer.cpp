#include "tools/mpt-train/trainer.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <optional>

#include <unistd.h>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "models/adamw.h"
#include "models/sgd.h"
#include "parallel/device_routed_group.h"
#include "parallel/rendezvous.h"
#include "parallel/settings_check.h"
#include "tensor/cuda_info.h"
#include "tensor/host_name.h"
#include "tensor/version.h"
#include "tools/mpt-train/checkpoint_files.h"
#include "diag/training_warnings.h"
#include "diag/gpu_sampler.h"
#include "tools/mpt-train/progress.h"
#include "tools/mpt-train/run_settings.h"
#include "tools/mpt-train/text_sample.h"
#include "train/trainer.h"
#include "train/workload.h"

namespace mpt::tools {
namespace {

using Clock = std::chrono::steady_clock;

// Set by SIGINT/SIGTERM: the run finishes its current step, writes its
// checkpoint and stops, so --resume continues it exactly. A second signal
// ends the process at once (the default action is back): the way out of a
// stop that waits for something that will not come.
std::atomic<bool> stop_requested{false};
extern "C" void request_stop(int sig) {
  stop_requested = true;
  std::signal(sig, SIG_DFL);
  static constexpr char kNotice[] = "mpt-train: stopping after this step; a second signal ends it now\n";
  [[maybe_unused]] const ssize_t n = ::write(STDERR_FILENO, kNotice, sizeof kNotice - 1);
}

// Installs the handlers for the run's duration.
class StopOnSignal {
 public:
  StopOnSignal() {
    stop_requested = false;
    previous_int_ = std::signal(SIGINT, request_stop);
    previous_term_ = std::signal(SIGTERM, request_stop);
  }
  ~StopOnSignal() {
    std::signal(SIGINT, previous_int_);
    std::signal(SIGTERM, previous_term_);
  }

 private:
  void (*previous_int_)(int);
  void (*previous_term_)(int);
};
// Under ddp, "auto" and "cuda" give each process the GPU of its LOCAL_RANK
// (local_rank is 0 otherwise).
Device pick_device(const std::string& spec, int local_rank) {
  if (spec == "auto") return cuda_device_count() > 0 ? Device(DeviceType::cuda, local_rank) : kCPU;
  const Device d = spec == "cuda" ? Device(DeviceType::cuda, local_rank) : Device(spec);
  check_device_available(d);
  return d;
}

// A launcher tells its workers their place through the environment; "auto"
// reads it as the rendezvous will (torchrun's and mpt-run's variables, else
// Open MPI's or Slurm's), so it means ddp wherever the rendezvous would find
// several processes.
std::string pick_parallel_mode(const std::string& mode) {
  if (mode != "auto") return mode;
  try {
    return dist::config_from_env(dist::process_env, /*need_master=*/false).world_size > 1 ? "ddp" : "none";
  } catch (const ValueError&) {
    return "none";  // no launcher's variables (or unusable ones): a process on its own
  }
}

// Under ddp each process trains on its own shard (its rank of the world the
// rendezvous found); otherwise one shuffled order of the whole set.
std::shared_ptr<data::Sampler> make_sampler(const std::optional<dist::Distributed>& world, int64_t size,
                                            uint64_t seed) {
  if (!world) return std::make_shared<data::SequentialOrRandomSampler>(size, true, seed);
  return std::make_shared<data::DistributedSampler>(size, world->config.world_size, world->config.rank, true, seed);
}

// The default warm-up is for long runs: a run of few steps would spend all
// of them climbing to the peak learning rate, so it warms up over its first
// tenth instead and says so. A warm-up that was asked for is kept, with a
// warning where it leaves no steps at the peak.
void settle_warmup(TrainConfig& c, int64_t total_steps, Progress& progress) {
  if (c.schedule == "constant" || total_steps <= 0) return;
  if (!c.settled.count("warmup-steps")) {
    if (c.warmup_steps * 10 <= total_steps) return;
    const int64_t shorter = total_steps / 10;
    progress.message(fmt::format("mpt-train: the default warm-up of {} steps is over a tenth of this run's {} steps: "
                                 "warming up over {} instead (--warmup-steps sets it)",
                                 c.warmup_steps, total_steps, shorter));
    c.warmup_steps = shorter;
    return;
  }
  if (c.warmup_steps >= total_steps)
    progress.message(fmt::format("mpt-train: warning: --warmup-steps {} is not shorter than this run's {} steps: the "
                                 "learning rate climbs the whole run and never decays",
                                 c.warmup_steps, total_steps));
}

std::unique_ptr<optim::Optimizer> make_optimizer(const TrainConfig& c, const std::vector<Tensor>& params) {
  if (c.optimizer == "adamw")
    return std::make_unique<optim::AdamW>(params, optim::AdamWOptions{.lr = c.lr, .weight_decay = c.weight_decay});
  check(c.optimizer == "sgd", "mpt-train: unknown --optimizer '{}' (adamw, sgd)", c.optimizer);
  return std::make_unique<optim::SGD>(
      params, optim::SGDOptions{.lr = c.lr, .momentum = c.momentum, .weight_decay = c.weight_decay});
}

optim::LrSchedule make_schedule(const TrainConfig& c, int64_t total_steps) {
  if (c.schedule == "constant") return optim::LrSchedule::constant(c.lr);
  check(c.schedule == "cosine" || c.schedule == "linear", "mpt-train: unknown --schedule '{}' (constant, cosine, linear)",
        c.schedule);
  const int64_t warmup = std::min(c.warmup_steps, std::max<int64_t>(total_steps - 1, 0));
  const int64_t total = std::max<int64_t>(total_steps, warmup + 1);
  const auto decay = c.schedule == "cosine" ? &optim::LrSchedule::cosine : &optim::LrSchedule::linear;
  return decay(c.lr, warmup, total, c.lr * c.min_lr_ratio);
}

// "cuda:0 (NVIDIA H200)", or "cpu".
std::string device_label(const Device& d) {
  if (!d.is_cuda()) return d.str();
  return fmt::format("{} ({})", d.str(), cuda::device_properties(d.index).name);
}

// The step-time breakdown as metrics fields: mean milliseconds per step.
nlohmann::ordered_json timing_fields(const StepBreakdown& b, double step_ms) {
  nlohmann::ordered_json j = {{"step_ms", step_ms}};
  for (int p = 0; p < kStepPhases; ++p)
    j[fmt::format("{}_ms", step_phase_name(static_cast<StepPhase>(p)))] = b.ms[p];
  return j;
}


// The loss scaler's options as the flags set them, checked with the
// scaler's own rule naming the flag. Run for every run, so that a wrong
// value is refused also where no scaler runs (bf16, fp32).
amp::GradScalerOptions scaler_options(const TrainConfig& c) {
  return c.scaler_flags.checked(amp::scale_policy_from_name(c.scaler == "dynamic" ? "torch" : c.scaler), "mpt-train");
}

// The run's workload, from its options.
train::WorkloadOptions workload_options(const TrainConfig& c) {
  return {.model = c.model, .data = c.data, .context = c.context, .gpt_layers = c.gpt_layers,
          .gpt_heads = c.gpt_heads, .gpt_d_model = c.gpt_d_model, .mlp_hidden = c.mlp_hidden};
}

// The replicas of --parallel dp: every GPU from cuda:0, or two virtual CPU
// devices on the CPU.
std::vector<Device> data_parallel_devices(const Device& device) {
  if (!device.is_cuda()) return {Device("cpu:0"), Device("cpu:1")};
  check<DeviceError>(device.index == 0, "mpt-train: --parallel dp uses every GPU from cuda:0, not {}", device.str());
  std::vector<Device> devices;
  for (int i = 0; i < cuda_device_count(); ++i) devices.emplace_back(DeviceType::cuda, i);
  return devices;
}

// The GPUs this node's ranks train on (the lead rank samples them all).
std::vector<int> gpus_in_use(const train::Trainer& t, bool distributed) {
  std::vector<int> gpus;
  if (const auto& o = t.options(); o.parallel == train::Parallel::dp) {
    for (const Device& d : o.dp_devices) gpus.push_back(d.index);
  } else if (distributed) {
    for (int i = 0; i < cuda_device_count(); ++i) gpus.push_back(i);  // one per local rank
  } else {
    gpus.push_back(t.device().index);
  }
  return gpus;
}

// Everything a study of the run needs to know about it, in its first line.
nlohmann::ordered_json start_event(const TrainConfig& c, train::Trainer& t, const train::Workload& w,
                                   const std::string& parallel, int world_size, int64_t total_steps,
                                   const std::optional<ckpt::Checkpoint>& saved) {
  nlohmann::ordered_json scaler = nullptr;  // no loss scaler outside fp16
  if (const amp::GradScaler* s = t.precision().scaler())
    scaler = {{"policy", c.scaler},
              {"init_scale", s->options().init_scale},
              {"growth_factor", s->options().growth_factor},
              {"backoff_factor", s->options().backoff_factor},
              {"growth_interval", s->options().growth_interval}};
  return {{"event", "start"}, {"model", c.model}, {"data", as_utf8(c.data)}, {"data_identity", w.data_identity},
          {"device", t.device().str()}, {"precision", c.precision}, {"scaler", scaler},
          {"batch_size", c.batch_size}, {"accumulation", c.accumulation}, {"optimizer", c.optimizer},
          {"lr", c.lr}, {"weight_decay", c.weight_decay},
          {"momentum", c.optimizer == "sgd" ? nlohmann::ordered_json(c.momentum) : nullptr},
          {"schedule", c.schedule}, {"warmup_steps", c.schedule == "constant" ? 0 : c.warmup_steps},
          {"min_lr_ratio", c.min_lr_ratio}, {"clip_grad_norm", c.clip_grad_norm}, {"total_steps", total_steps},
          {"seed", c.seed}, {"parallel", parallel}, {"world_size", world_size}, {"cuda_graph", t.graph()},
          {"resumed", saved.has_value()},
          {"resumed_from", saved ? nlohmann::ordered_json(as_utf8(c.resume)) : nullptr},
          {"resumed_at_step", saved ? nlohmann::ordered_json(saved->step) : nullptr},
          {"mptrain_version", library_version()}};
}

// What the checkpoint's run trained on must be what this one reads (the
// same bytes, wherever they lie), in as many shards; a checkpoint from
// before the configuration was recorded names a few options instead.
void check_resumed_run(const TrainConfig& c, const ckpt::Checkpoint& saved, const nlohmann::json& saved_config,
                       const std::string& data_identity, int world_size) {
  const auto recorded = [&](const std::string& key) {
    const auto it = saved.info.find(key);
    return it == saved.info.end() ? std::optional<std::string>() : it->second;
  };
  if (!saved_config.is_object()) check_older_record(c, saved, c.resume);
  const auto data = recorded("run.data_identity");
  check(!data || *data == data_identity,
        "mpt-train: --resume '{}': the checkpoint's run trained on other data ({}) than this run's --data '{}' ({})",
        c.resume, data.value_or(""), c.data, data_identity);
  const auto shards = recorded("run.world_size");
  check(!shards || *shards == std::to_string(world_size),
        "mpt-train: --resume '{}': the checkpoint's run was a job of {} rank(s), this one has {}: its data position "
        "counts batches of that many shards",
        c.resume, shards.value_or(""), world_size);
}

// Ranks started with different settings end here, every one of them,
// naming what differs (they would hang in their first collective, or train
// on apart).
void check_ranks_agree(const TrainConfig& c, const dist::Distributed& world, const std::string& data_identity,
                       const Device& device, bool graph, const std::optional<ckpt::Checkpoint>& saved) {
  dist::Settings settings = rank_settings(c);
  settings.emplace_back("the data", data_identity);
  settings.emplace_back("the device type", device.is_cuda() ? "cuda" : "cpu");
  settings.emplace_back("the CUDA graph", graph ? "on" : "off");
  settings.emplace_back("the world size", std::to_string(world.config.world_size));
  settings.emplace_back("the checkpoint resumed", saved ? fmt::format("step {}", saved->step) : "none");
  settings.emplace_back("the mptrain version", library_version());
  dist::check_same_settings(*world.store, world.config.rank, world.config.world_size, settings);
}

// The library's step and loop as the options ask for them.
train::TrainerOptions trainer_options(const TrainConfig& c, const Device& device, train::Parallel parallel,
                                      const std::optional<dist::Distributed>& world, int64_t total_steps,
                                      Generator& gen) {
  train::TrainerOptions o;
  o.step.precision = train::precision_from_name(c.precision);
  o.step.fp8.scaling = amp::fp8_scaling_mode_from_name(c.fp8_recipe);
  o.step.fp8.history_length = c.fp8_history;
  o.step.fp8.margin = static_cast<float>(c.fp8_margin);
  o.step.fp8.forward_fast_accumulation = c.fp8_forward_accumulation == "fast";
  o.step.scaler = scaler_options(c);
  o.step.cuda_graph = train::graph_mode_from_name(c.cuda_graph);
  o.step.max_grad_norm = c.clip_grad_norm;
  o.device = device;
  o.parallel = parallel;
  if (world) {
    o.group = world->group;
    if (c.grad_transit != "f32") o.ddp.compression = dtype_from_name(c.grad_transit);
  }
  if (parallel == train::Parallel::dp) {
    o.dp_devices = data_parallel_devices(device);
    o.make_replica = [c] {
      Generator g(c.seed);
      return train::make_workload(workload_options(c), g).model;
    };
  }
  o.schedule = make_schedule(c, total_steps);
  o.rng = &gen;
  return o;
}

}  // namespace

void check_options(const TrainConfig& c) {
  check(c.accumulation >= 1 && c.epochs >= 1 && c.batch_size >= 0 && c.max_steps >= 0,
        "mpt-train: --accumulation {} and --epochs {} must be positive, --batch-size {} and --steps {} not negative",
        c.accumulation, c.epochs, c.batch_size, c.max_steps);
  check(c.parallel == "auto" || c.parallel == "none" || c.parallel == "dp" || c.parallel == "ddp",
        "mpt-train: unknown --parallel '{}' (auto, none, dp, ddp)", c.parallel);
  check(c.grad_transit == "f32" || c.grad_transit == "f16" || c.grad_transit == "bf16",
        "mpt-train: unknown --grad-transit '{}' (f32, f16, bf16)", c.grad_transit);
  check(c.log_every >= 1 && c.eval_batches >= 0 && c.checkpoint_every >= 0 && c.stop_after >= 0,
        "mpt-train: --log-every {} must be positive, --eval-batches {}, --checkpoint-every {} and --stop-after {} not "
        "negative",
        c.log_every, c.eval_batches, c.checkpoint_every, c.stop_after);
  check(c.lr >= 0 && c.weight_decay >= 0 && c.momentum >= 0,
        "mpt-train: --lr {}, --weight-decay {} and --momentum {} must not be negative", c.lr, c.weight_decay,
        c.momentum);
  check(c.min_lr_ratio >= 0 && c.min_lr_ratio <= 1, "mpt-train: --min-lr-ratio must be in [0, 1], got {}",
        c.min_lr_ratio);
  check(c.cuda_graph == "auto" || c.cuda_graph == "on" || c.cuda_graph == "off",
        "mpt-train: unknown --cuda-graph '{}' (auto, on, off)", c.cuda_graph);
  // GPT's heads split d_model evenly (checked here, not after the data is read).
  check(c.model != "gpt" || (c.gpt_heads >= 1 && c.gpt_d_model % c.gpt_heads == 0),
        "mpt-train: --gpt-d-model {} must be a multiple of --gpt-heads {}", c.gpt_d_model, c.gpt_heads);
  check(c.sample_tokens >= 0 && c.sample_top_k >= 0,
        "mpt-train: --sample-tokens {} and --sample-top-k {} must not be negative", c.sample_tokens, c.sample_top_k);
  check(std::isfinite(c.sample_temperature) && c.sample_temperature >= 0,
        "mpt-train: --sample-temperature must be finite and not negative (0: the likeliest character), got {}",
        c.sample_temperature);
  scaler_options(c);  // the loss-scaler options, whether or not this run uses them
}

TrainResult run_training(const TrainConfig& config) {
  TrainConfig c = config;
  // --auto-resume: an existing checkpoint is the run to continue.
  std::error_code no_file;
  if (c.auto_resume && std::filesystem::exists(c.checkpoint, no_file)) c.resume = c.checkpoint;
  // --resume: the checkpoint's run, with the options it recorded for every
  // one not given again. Read whole once; restored after the model is built.
  std::optional<ckpt::Checkpoint> saved;
  nlohmann::json saved_config;
  if (!c.resume.empty()) {
    saved = ckpt::read_checkpoint(c.resume);
    saved_config = recorded_config(*saved, c.resume);
    if (saved_config.is_object()) take_saved_options(c, saved_config);
  }
  if (c.batch_size == 0) c.batch_size = c.model == "gpt" ? 64 : 128;
  c.data = recorded_path(train::workload_data(workload_options(c)));  // data for the wrong model: make_workload refuses it
  c.checkpoint = recorded_path(c.checkpoint);
  c.metrics = recorded_path(c.metrics);
  check_options(c);
  const std::string parallel = pick_parallel_mode(c.parallel);
  check(c.grad_transit == "f32" || parallel == "ddp",
        "mpt-train: --grad-transit {} compresses DDP's all-reduces; it needs --parallel ddp (this run is {})",
        c.grad_transit, parallel);
  // ddp: join the other ranks (rendezvous from the launcher's variables); only
  // rank 0 reports and writes checkpoints.
  std::optional<dist::Distributed> world;
  if (parallel == "ddp") {
    dist::ProcessGroupOptions options;
    options.timeout = std::chrono::milliseconds(static_cast<int64_t>(c.dist_timeout * 1000));
    world = dist::init_process_group("env://", options);
  }
  const int rank = world ? world->config.rank : 0, world_size = world ? world->config.world_size : 1;
  const bool lead = rank == 0;
  if (!lead) {
    c.progress = "none";
    c.metrics.clear();
  }
  if (lead && !c.checkpoint.empty()) {
    refuse_to_replace(c);
    prepare_checkpoint_path(c.checkpoint);
  }
  if (lead && c.stop_after > 0 && c.checkpoint.empty())
    fmt::print(stderr, "mpt-train: warning: --stop-after {} without --checkpoint: nothing is saved for --resume to "
                       "continue from\n", c.stop_after);
  const auto started = Clock::now();
  Progress progress(c.progress, c.epochs, c.metrics);
  const Device device = pick_device(c.device, world ? world->config.local_rank : 0);
  const bool auto_precision = c.precision == "auto";
  if (auto_precision) c.precision = train::precision_name(train::default_precision(device));
  if (saved_config.is_object()) check_fixed_options(c, saved_config, c.resume);
  const train::Parallel parallel_mode = train::parallel_from_name(parallel);
  const std::string obstacle = train::graph_obstacle(device, parallel_mode);
  check(c.cuda_graph != "on" || obstacle.empty(), "mpt-train: --cuda-graph on cannot be: {}",
        parallel_mode == train::Parallel::dp && device.is_cuda() ? "--parallel dp drives every GPU from one step"
                                                                 : obstacle);
  std::vector<std::string> scaler_flags;
  for (const char* flag : {"scaler", "init-scale", "growth-factor", "backoff-factor", "growth-interval"})
    if (c.given.count(flag)) scaler_flags.push_back(fmt::format("--{}", flag));
  if (lead && c.precision != "fp16" && !scaler_flags.empty())
    fmt::print(stderr, "mpt-train: warning: {} ignored: the loss scaler runs with --precision fp16 only, and this run "
                       "is {}{}\n", fmt::join(scaler_flags, ", "), c.precision, auto_precision ? " (auto on this device)" : "");

  Generator gen(c.seed);
  train::Workload w = train::make_workload(workload_options(c), gen);
  const TextSampler text_sampler(w, c);  // (checks --sample-prompt before any training)
  w.model->to(device);

  if (saved) check_resumed_run(c, *saved, saved_config, w.data_identity, world_size);
  if (world) check_ranks_agree(c, *world, w.data_identity, device, c.cuda_graph != "off" && obstacle.empty(), saved);

  data::DataLoader loader(w.train_set, make_sampler(world, w.train_set->size(), c.seed),
                          {.batch_size = c.batch_size, .num_workers = c.workers, .prefetch = 4,
                           .pin_memory = device.is_cuda()});
  const int64_t total_steps = train::planned_steps(loader.batches_per_epoch(), c.epochs, c.accumulation, c.max_steps);
  settle_warmup(c, total_steps, progress);

  const train::TrainerOptions options = trainer_options(c, device, parallel_mode, world, total_steps, gen);
  train::Trainer trainer(w.model, make_optimizer(c, w.model->parameters()), w.objective, options);
  if (saved) {
    trainer.restore(*saved, fmt::format("mpt-train: --resume '{}'", c.resume));
    // Saved after an epoch's last batch, the run goes on with the next epoch.
    data::DataPosition at = trainer.position();
    if (at.batch >= loader.batches_per_epoch()) at = {at.epoch + 1, 0};
    progress.message(fmt::format("resumed from '{}' at step {} (epoch {}, batch {})", c.resume, trainer.steps(),
                                 at.epoch + 1, at.batch));
  }

  // Every rank says once who and where it is (mpt-run prefixes the lines).
  std::string devices_text = device_label(device);
  if (parallel_mode == train::Parallel::dp) {
    devices_text.clear();
    for (const Device& d : options.dp_devices) devices_text += (devices_text.empty() ? "" : ", ") + device_label(d);
  }
  fmt::print("rank {} of {}: host {}, pid {}, device {}{}\n", rank, world_size, host_name(), ::getpid(),
             devices_text, parallel_mode == train::Parallel::dp ? " (DataParallel)" : "");
  std::fflush(stdout);
  progress.message(fmt::format("mpt-train: {}, {} parameters, on {}, {}, batch {} x {}, {} lr {:g} ({}), {} steps{}",
                               w.description, w.model->parameter_count(), device.str(), c.precision, c.batch_size,
                               c.accumulation, c.optimizer, c.lr, c.schedule, total_steps,
                               trainer.graph() ? ", CUDA graph" : ""));
  progress.record(start_event(c, trainer, w, parallel, world_size, total_steps, saved));
  progress.record({{"event", "rank"}, {"rank", rank}, {"world_size", world_size}, {"host", host_name()},
                   {"pid", ::getpid()}, {"device", devices_text}});

  // On the lead rank, a sampler of the GPUs this node's ranks use.
  std::unique_ptr<diag::GpuSampler> gpu_sampler;
  if (lead && device.is_cuda()) {
    gpu_sampler = std::make_unique<diag::GpuSampler>(
        gpus_in_use(trainer, world.has_value()), std::chrono::milliseconds(1000),
        [&progress](const nlohmann::ordered_json& r) { progress.record(r); },
        [&progress](const std::string& m) { progress.message(m); });
    if (!gpu_sampler->running()) progress.message("mpt-train: GPU sampler off: " + gpu_sampler->reason());
  }

  TrainResult result;
  auto evaluate_model = [&] {
    const train::Evaluation e =
        trainer.evaluate(*w.eval_set, w.sequences ? c.batch_size : 500, c.eval_batches, w.eval_stride);
    result.eval_loss = e.loss;
    result.eval_accuracy = e.accuracy;
    return e;
  };
  const int64_t steps_per_epoch = train::planned_steps(loader.batches_per_epoch(), 1, c.accumulation);
  bool first_batch_reported = false, fallback_reported = false;
  train::FitCallbacks callbacks;
  callbacks.before_step = [&](const std::vector<data::Batch>& micro_batches) {
    if (first_batch_reported) return;
    const Tensor& input = micro_batches.front().input;
    fmt::print("rank {} of {}: first input batch {}{} on {}{}\n", rank, world_size, dtype_name(input.dtype()),
               shape_str(input.shape()), device.str(),
               parallel_mode == train::Parallel::dp ? ", split over the replicas by DataParallel" : "");
    std::fflush(stdout);
    first_batch_reported = true;
  };
  callbacks.on_step = [&](int64_t) {
    if (!fallback_reported && !trainer.graph_fallback_reason().empty()) {
      progress.message("mpt-train: the step could not be captured as a CUDA graph and runs eagerly: " +
                       trainer.graph_fallback_reason());
      fallback_reported = true;
    }
    const data::DataPosition& at = trainer.position();
    const int64_t in_epoch = at.batch / c.accumulation + (at.batch % c.accumulation != 0 ? 1 : 0);
    progress.tick(at.epoch, in_epoch, steps_per_epoch, [&] { return trainer.totals().step_loss(); });
  };
  callbacks.on_log = [&](const train::StepMetrics& m) {
    // Under ddp every rank trains its own shard in the same time: the job's
    // rate is the world's multiple of the rank's.
    const double rank_rate = m.samples / std::max(m.seconds, 1e-9);
    nlohmann::ordered_json fields = timing_fields(m.timing, 1e3 * m.seconds / std::max<int64_t>(m.timing.steps, 1));
    fields["scale"] = m.scale;
    fields["skipped_steps_in_run"] = m.skipped_steps;
    if (world) {
      fields["rank_samples_per_s"] = rank_rate;
      fields["rank_work_ms"] = m.rank_work_ms;
      if (auto warning = diag::imbalance_warning(m.rank_work_ms)) progress.message(*warning);
    }
    progress.log(m.step, m.loss, m.lr, rank_rate * world_size, fields);
  };
  callbacks.on_epoch = [&](const train::EpochMetrics& e) {
    const train::Evaluation eval = evaluate_model();
    nlohmann::ordered_json summary = {{"event", "epoch"},
                                      {"epoch", e.epoch + 1},
                                      {"step", e.step},
                                      {"train_loss", e.train_loss},
                                      {"train_accuracy", e.train_accuracy},
                                      {"eval_loss", eval.loss},
                                      {"eval_accuracy", eval.accuracy},
                                      {"samples_per_s", world_size * e.samples / std::max(e.seconds, 1e-9)},
                                      {"seconds", e.seconds},
                                      {"scale", trainer.precision().scale()},
                                      {"skipped_steps", e.skipped_steps}};
    if (world) summary["rank_samples_per_s"] = e.samples / std::max(e.seconds, 1e-9);
    if (trainer.graph()) {
      summary["graph_captures"] = trainer.graph_captures();
      summary["graph_replays"] = trainer.graph_replays();
    }
    const nlohmann::ordered_json timing =
        timing_fields(e.timing, 1e3 * e.seconds / std::max<int64_t>(e.timing.steps, 1));
    for (const auto& [k, v] : timing.items()) summary[k] = v;
    // Every rank samples (the others print nothing), so that none waits in
    // its next all-reduce for rank 0's sample.
    progress.end_epoch(e.epoch, c.epochs, summary);
    text_sampler.sample(e.step, progress);
  };
  callbacks.stop_requested = [] { return stop_requested.load(); };

  train::FitOptions fit;
  fit.epochs = c.epochs;
  fit.max_steps = c.max_steps;
  fit.stop_after = c.stop_after;
  fit.accumulation = c.accumulation;
  fit.log_every = c.log_every;
  fit.checkpoint = c.checkpoint;
  fit.checkpoint_every = c.checkpoint_every;
  fit.checkpoint_info = run_record(c, world_size, w.data_identity);
  train::FitResult fitted;
  {
    StopOnSignal stop_on_signal;
    fitted = trainer.fit(loader, fit, callbacks);
  }
  gpu_sampler.reset();
  // Nothing was left to train (a finished run resumed, or --steps lowered
  // below the checkpoint's): the end still reports the model's test figures.
  if (fitted.finished && !fitted.evaluated_epoch) {
    evaluate_model();
    text_sampler.sample(trainer.steps(), progress);
  }
  result.steps = fitted.steps;
  result.seconds = std::chrono::duration<double>(Clock::now() - started).count();
  result.stopped_early = !fitted.finished;
  result.interrupted = fitted.stopped;
  if (result.stopped_early) {
    progress.record({{"event", "interrupted"}, {"reason", result.interrupted ? "signal" : "stop-after"},
                     {"steps", result.steps}, {"seconds", result.seconds}});
    progress.message(fmt::format("mpt-train: {} after step {}{}",
                                 result.interrupted ? "interrupted" : "stopped (--stop-after)", result.steps,
                                 c.checkpoint.empty() ? "" : fmt::format("; --resume '{}' continues", c.checkpoint)));
  } else {
    progress.record({{"event", "end"}, {"steps", result.steps}, {"eval_loss", result.eval_loss},
                     {"eval_accuracy", result.eval_accuracy}, {"seconds", result.seconds}});
    progress.message(fmt::format("mpt-train: done: {} steps in {:.1f} s, test loss {:.4f}, test accuracy {:.2f}%{}",
                                 result.steps, result.seconds, result.eval_loss, 100 * result.eval_accuracy,
                                 c.checkpoint.empty() ? "" : fmt::format("; checkpoint written to '{}'", c.checkpoint)));
  }
  return result;
}

}  // namespace mpt::tools
