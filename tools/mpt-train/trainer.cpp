#include "tools/mpt-train/trainer.h"

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <limits>
#include <optional>

#include <unistd.h>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "autograd/ops.h"
#include "models/adamw.h"
#include "models/checkpoint.h"
#include "models/dataset.h"
#include "models/lr_schedule.h"
#include "models/sgd.h"
#include "models/training_mode.h"
#include "parallel/data_parallel.h"
#include "parallel/device_routed_group.h"
#include "parallel/distributed_data_parallel.h"
#include "parallel/rendezvous.h"
#include "tensor/cuda_info.h"
#include "tensor/host_name.h"
#include "tensor/nvtx.h"
#include "tensor/step_timer.h"
#include "tensor/version.h"
#include "tools/mpt-train/diagnostics.h"
#include "tools/mpt-train/gpu_sampler.h"
#include "tools/mpt-train/precision_step.h"
#include "tools/mpt-train/progress.h"
#include "tools/mpt-train/run_settings.h"
#include "tools/mpt-train/text_sample.h"
#include "tools/mpt-train/training_step.h"
#include "tools/mpt-train/training_totals.h"
#include "tools/mpt-train/workload.h"

namespace mpt::train {
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
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

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

// Makes the checkpoint's folder before training, so that a path that cannot
// be written fails now rather than at the first save, after the work.
void prepare_checkpoint_path(const std::string& checkpoint) {
  namespace fs = std::filesystem;
  std::error_code ignored;
  check<IOError>(!fs::is_directory(checkpoint, ignored), "mpt-train: --checkpoint '{}' is a folder; name a file in it",
                 checkpoint);
  const fs::path dir = fs::path(checkpoint).parent_path();
  if (!dir.empty()) {
    std::error_code error;
    fs::create_directories(dir, error);
    check<IOError>(!error, "mpt-train: --checkpoint '{}': cannot make its folder '{}': {}", checkpoint, dir.string(),
                   error.message());
  }
  const std::string folder = dir.empty() ? "." : dir.string();
  check<IOError>(::access(folder.c_str(), W_OK | X_OK) == 0, "mpt-train: --checkpoint '{}': cannot write into '{}': {}",
                 checkpoint, folder, std::strerror(errno));
}

// What a checkpoint records about its run: the whole configuration (the
// options as this run resolved them), how many shards its data position
// counts in, and what the data was.
io::Metadata run_record(const TrainConfig& c, int64_t world_size, const std::string& data_identity) {
  return {{"run.config", saved_options(c).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)},
          {"run.world_size", std::to_string(world_size)},
          {"run.data_identity", data_identity}};
}

// The run configuration a checkpoint recorded; null for one written before
// checkpoints recorded it.
nlohmann::json recorded_config(const ckpt::Checkpoint& saved, const std::string& source) {
  const auto it = saved.info.find("run.config");
  if (it == saved.info.end()) return nullptr;
  try {
    nlohmann::json config = nlohmann::json::parse(it->second);
    check(config.is_object(), "not an object");
    return config;
  } catch (const std::exception& e) {
    throw IOError(fmt::format("mpt-train: --resume '{}': the checkpoint's run configuration is not readable: {}", source,
                              e.what()));
  }
}

// A checkpoint written before the whole configuration was recorded names a
// few options of its run ("run.model", ...): those must agree.
void check_older_record(const TrainConfig& c, const ckpt::Checkpoint& saved, const std::string& source) {
  const io::Metadata expected{{"run.model", c.model},
                              {"run.batch_size", std::to_string(c.batch_size)},
                              {"run.accumulation", std::to_string(c.accumulation)},
                              {"run.seed", std::to_string(c.seed)},
                              {"run.optimizer", c.optimizer},
                              {"run.precision", c.precision},
                              {"run.scaler", c.scaler}};
  for (const auto& [key, value] : expected) {
    const auto it = saved.info.find(key);
    check(it == saved.info.end() || it->second == value,
          "mpt-train: --resume '{}' was written for {} '{}', but this run has '{}'", source, key,
          it == saved.info.end() ? "" : it->second, value);
  }
}

// Whether two paths name one file (both exist).
bool same_file(const std::string& a, const std::string& b) {
  std::error_code error;
  return std::filesystem::equivalent(a, b, error);
}

// A run writes --checkpoint over an existing file only when it continues
// that file's run, or when told to: another run's checkpoint (an MLP's
// under the name of a CNN's) is not replaced by mistake.
void refuse_to_replace(const TrainConfig& c) {
  namespace fs = std::filesystem;
  std::error_code error;
  if (c.checkpoint.empty() || c.overwrite || !fs::exists(c.checkpoint, error)) return;
  if (!c.resume.empty() && same_file(c.resume, c.checkpoint)) return;
  std::string what;
  try {
    const ckpt::Checkpoint existing = ckpt::read_checkpoint(c.checkpoint);
    const nlohmann::json config = recorded_config(existing, c.checkpoint);
    const std::string model = config.is_object() && config.contains("model") ? config["model"].get<std::string>()
                                                                             : "a model";
    what = fmt::format("it holds a run of {} at step {}", model, existing.step);
  } catch (const std::exception&) {
    what = "it is not a checkpoint this run can read";
  }
  throw IOError(fmt::format("mpt-train: --checkpoint '{}' already exists ({}), and this run would replace it. Continue "
                            "that run with --resume '{}' (or --auto-resume), or replace it with --overwrite",
                            c.checkpoint, what, c.checkpoint));
}

// A path the run records: absolute, so that a resumed run finds it from
// any folder. The data sets' own names stay names.
std::string recorded_path(const std::string& path) {
  if (path.empty() || path == "fashion-mnist" || path == "fortunes") return path;
  return std::filesystem::absolute(path).lexically_normal().string();
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

// An epoch at a stop in its middle: what its steps so far add up to, kept
// in the checkpoint's extra tensors ("epoch.*") so that the resumed run
// sums up the whole epoch, not only the part after the stop.
struct EpochSoFar {
  TrainingTotals::Sums sums;
  int64_t first_step = 0;    // the run's step count at the epoch's start
  int64_t first_update = 0;  // and the first parameter's update count (skipped steps show as missing updates)
};

constexpr const char* kEpochKeys[] = {"epoch.loss_sum", "epoch.correct", "epoch.predictions", "epoch.first_step",
                                      "epoch.first_update"};

OrderedDict<Tensor> epoch_state(const EpochSoFar& e) {
  const double values[] = {e.sums.loss, e.sums.correct, static_cast<double>(e.sums.predictions),
                           static_cast<double>(e.first_step), static_cast<double>(e.first_update)};
  OrderedDict<Tensor> out;
  for (size_t i = 0; i < std::size(kEpochKeys); ++i) out.insert(kEpochKeys[i], scalar_tensor(values[i], DType::f64));
  return out;
}

// Nothing from a checkpoint written before these entries existed.
std::optional<EpochSoFar> read_epoch_state(const OrderedDict<Tensor>& state, const std::string& source) {
  if (state.empty()) return std::nullopt;
  double values[std::size(kEpochKeys)];
  for (size_t i = 0; i < std::size(kEpochKeys); ++i) {
    const Tensor* t = state.find(kEpochKeys[i]);
    check(t && t->numel() == 1, "mpt-train: --resume '{}': the checkpoint's epoch totals lack '{}'", source,
          kEpochKeys[i]);
    values[i] = t->item();
    check(std::isfinite(values[i]) && values[i] >= 0,
          "mpt-train: --resume '{}': the checkpoint's '{}' is {}, not a count", source, kEpochKeys[i], values[i]);
  }
  check(state.size() == std::size(kEpochKeys), "mpt-train: --resume '{}': unexpected epoch entries in the checkpoint",
        source);
  return EpochSoFar{{values[0], values[1], static_cast<int64_t>(values[2])},
                    static_cast<int64_t>(values[3]),
                    static_cast<int64_t>(values[4])};
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

struct Evaluation {
  double loss = 0, accuracy = 0;
};

Evaluation evaluate(const Workload& w, const Device& device, int64_t batch_size, int64_t max_batches) {
  NoGradGuard no_grad;
  nn::EvalModeGuard eval_mode(*w.model);
  // Text windows overlap; evaluating every context-th one covers the
  // held-out text once.
  std::vector<int64_t> samples;
  for (int64_t i = 0; i < w.eval_set->size(); i += w.eval_stride) samples.push_back(i);
  // Counted on the device: the batches follow each other without waiting
  // for the GPU, which is read once at the end.
  TrainingTotals totals(device);
  totals.start_epoch();
  int64_t batches = 0;
  for (size_t first = 0; first < samples.size() && (max_batches == 0 || batches < max_batches);
       first += static_cast<size_t>(batch_size), ++batches) {
    const size_t last = std::min(samples.size(), first + static_cast<size_t>(batch_size));
    const data::Batch b = w.eval_set->get_batch(std::vector<int64_t>(samples.begin() + first, samples.begin() + last));
    const Tensor target = prim::to(b.target, device);
    const Tensor out = w.forward(prim::to(b.input, device));
    totals.count(w.predictions(b));
    totals.add(w.loss(out, target), out, target, 1.0);
  }
  return {totals.mean_loss(), totals.accuracy()};
}

// Why this run's step cannot be captured as a CUDA graph (empty: it can).
std::string cuda_graph_obstacle(const TrainConfig& c, const Device& device, const std::string& parallel) {
  if (!device.is_cuda()) return fmt::format("the run is on {}, not a GPU", device.str());
  if (parallel == "dp") return "--parallel dp drives every GPU from one step";
  return "";
}

// DataParallel's step: every device runs forward, loss and backward on its
// share of each micro-batch. The loss function also counts its device's
// right predictions, on the host: the replicas return the loss there anyway.
void dp_step(dist::DataParallel& dp, const Workload& w, PrecisionStep& precision, optim::Optimizer& optimizer,
             TrainingTotals& totals, const std::vector<data::Batch>& batches) {
  optimizer.zero_grad();
  totals.start_step();
  const auto group = static_cast<int64_t>(batches.size());
  const double weight = 1.0 / static_cast<double>(group);
  for (const data::Batch& b : batches) {
    std::atomic<int64_t> right{0};
    auto loss_fn = [&](const Tensor& out, const Tensor& y) {
      right += w.correct(out, y);
      const Tensor l = w.loss(out, y);
      return group > 1 ? l * weight : l;
    };
    const Tensor x = w.flatten_input ? flatten(b.input, 1) : b.input;
    const double value =
        precision.forward([&] { return dp.forward_backward(x, b.target, loss_fn, precision.scaler()); }) / weight;
    totals.add(value, right, w.predictions(b), weight);
  }
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
  const bool auto_resumed = c.auto_resume && std::filesystem::exists(c.checkpoint, no_file);
  if (auto_resumed) c.resume = c.checkpoint;
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
  // Data given for the wrong model is refused by make_workload.
  if (c.data.empty()) c.data = c.model == "gpt" ? "fortunes" : "fashion-mnist";
  c.data = recorded_path(c.data);
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
  const bool lead = !world || world->config.rank == 0;
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
  Progress progress(c.progress, c.log_every, c.metrics);
  const Device device = pick_device(c.device, world ? world->config.local_rank : 0);
  const bool auto_precision = c.precision == "auto";
  if (auto_precision) c.precision = device.is_cuda() ? "fp16" : "bf16";
  if (saved_config.is_object()) check_fixed_options(c, saved_config, c.resume);
  const std::string graph_obstacle = cuda_graph_obstacle(c, device, parallel);
  check(c.cuda_graph != "on" || graph_obstacle.empty(), "mpt-train: --cuda-graph on cannot be: {}", graph_obstacle);
  std::vector<std::string> scaler_flags;
  for (const char* flag : {"scaler", "init-scale", "growth-factor", "backoff-factor", "growth-interval"})
    if (c.given.count(flag)) scaler_flags.push_back(fmt::format("--{}", flag));
  if (lead && c.precision != "fp16" && !scaler_flags.empty())
    fmt::print(stderr, "mpt-train: warning: {} ignored: the loss scaler runs with --precision fp16 only, and this run "
                       "is {}{}\n", fmt::join(scaler_flags, ", "), c.precision, auto_precision ? " (auto on this device)" : "");
  Generator gen(c.seed);
  Workload w = make_workload(c, gen);
  const TextSampler text_sampler(w, c);  // (checks --sample-prompt before any training)
  w.model->to(device);
  std::unique_ptr<optim::Optimizer> optimizer = make_optimizer(c, w.model->parameters());
  PrecisionStep precision(c, *optimizer, device);
  // dp: one process, a replica per device (every GPU; two virtual CPU
  // devices on the CPU), gradients summed into the model on devices[0].
  std::unique_ptr<dist::DataParallel> dp;
  if (parallel == "dp") {
    std::vector<Device> devices;
    if (device.is_cuda()) {
      check<DeviceError>(device.index == 0, "mpt-train: --parallel dp uses every GPU from cuda:0, not {}", device.str());
      for (int i = 0; i < cuda_device_count(); ++i) devices.emplace_back(DeviceType::cuda, i);
    } else {
      devices = {Device("cpu:0"), Device("cpu:1")};
    }
    dp = std::make_unique<dist::DataParallel>(
        w.model, [&c] { Generator g(c.seed); return make_workload(c, g).model; }, devices);
  }
  // Every rank says once who and where it is (mpt-run prefixes the lines).
  const int rank = world ? world->config.rank : 0, world_size = world ? world->config.world_size : 1;
  std::string devices_text = device_label(device);
  if (dp) {
    devices_text.clear();
    for (const Device& d : dp->devices()) devices_text += (devices_text.empty() ? "" : ", ") + device_label(d);
  }
  fmt::print("rank {} of {}: host {}, pid {}, device {}{}\n", rank, world_size, host_name(), ::getpid(),
             devices_text, dp ? " (DataParallel)" : "");
  std::fflush(stdout);
  bool first_batch_reported = false;

  // What the checkpoint's run trained on must be what this one reads (the
  // same bytes, wherever they lie), in as many shards.
  if (saved) {
    const auto recorded = [&](const std::string& key) {
      const auto it = saved->info.find(key);
      return it == saved->info.end() ? std::optional<std::string>() : it->second;
    };
    if (!saved_config.is_object()) check_older_record(c, *saved, c.resume);
    const auto data_identity = recorded("run.data_identity");
    check(!data_identity || *data_identity == w.data_identity,
          "mpt-train: --resume '{}': the checkpoint's run trained on other data ({}) than this run's --data '{}' ({})",
          c.resume, data_identity.value_or(""), c.data, w.data_identity);
    const auto shards = recorded("run.world_size");
    check(!shards || *shards == std::to_string(world_size),
          "mpt-train: --resume '{}': the checkpoint's run was a job of {} rank(s), this one has {}: its data position "
          "counts batches of that many shards",
          c.resume, shards.value_or(""), world_size);
  }

  // The step is captured as a CUDA graph where it can be.
  const bool graph = c.cuda_graph != "off" && graph_obstacle.empty();

  // Ranks started with different settings end here, every one of them,
  // naming what differs (they would hang in their first collective, or
  // train on apart).
  if (world) {
    dist::Settings settings = rank_settings(c);
    settings.emplace_back("the data", w.data_identity);
    settings.emplace_back("the device type", device.is_cuda() ? "cuda" : "cpu");
    settings.emplace_back("the CUDA graph", graph ? "on" : "off");
    settings.emplace_back("the world size", std::to_string(world_size));
    settings.emplace_back("the checkpoint resumed", saved ? fmt::format("step {}", saved->step) : "none");
    settings.emplace_back("the mptrain version", library_version());
    dist::check_same_settings(*world->store, rank, world_size, settings);
  }

  std::unique_ptr<dist::DistributedDataParallel> ddp;
  if (world) {
    dist::DdpOptions options;
    if (c.grad_transit != "f32") options.compression = dtype_from_name(c.grad_transit);
    ddp = std::make_unique<dist::DistributedDataParallel>(w.model, world->group, options);
    // Every rank skips or takes the same step.
    if (amp::GradScaler* scaler = precision.scaler())
      scaler->set_found_inf_reducer([&ddp](Tensor& found_inf) { ddp->allreduce_found_inf(found_inf); });
  }

  auto sampler = make_sampler(world, w.train_set->size(), c.seed);
  data::DataLoader loader(w.train_set, sampler,
                          {.batch_size = c.batch_size, .num_workers = c.workers, .prefetch = 4,
                           .pin_memory = device.is_cuda()});
  const int64_t batches = loader.batches_per_epoch();
  // Counted without overflow, whatever the options' sizes (a batch or an
  // accumulation near the int64 limit, --epochs to run until --steps).
  const int64_t steps_per_epoch = batches / c.accumulation + (batches % c.accumulation != 0 ? 1 : 0);
  constexpr int64_t kMaxSteps = std::numeric_limits<int64_t>::max();
  const int64_t all_epochs_steps =
      steps_per_epoch > 0 && c.epochs > kMaxSteps / steps_per_epoch ? kMaxSteps : c.epochs * steps_per_epoch;
  const int64_t total_steps = c.max_steps > 0 ? std::min(c.max_steps, all_epochs_steps) : all_epochs_steps;
  settle_warmup(c, total_steps, progress);
  const optim::LrSchedule schedule = make_schedule(c, total_steps);

  int64_t step = 0;
  data::DataPosition position;
  std::optional<EpochSoFar> resumed_epoch;  // the epoch the resumed run starts in the middle of
  if (saved) {
    OrderedDict<Tensor> scaler_state, epoch_entries;
    for (const auto& [key, t] : saved->extra)
      (key.rfind("epoch.", 0) == 0 ? epoch_entries : scaler_state).insert(key, t);
    const std::optional<EpochSoFar> saved_epoch = read_epoch_state(epoch_entries, c.resume);
    precision.load_state_dict(scaler_state);  // all or nothing, before the model is touched
    ckpt::restore(*saved, *w.model, *optimizer, gen, c.resume);
    step = saved->step;
    position = saved->position;
    // Saved at an epoch's end (summed up before that stop): the next one.
    if (position.batch >= batches) position = {position.epoch + 1, 0};
    if (position.batch > 0) resumed_epoch = saved_epoch;
    progress.message(fmt::format("resumed from '{}' at step {} (epoch {}, batch {})", c.resume, step,
                                 position.epoch + 1, position.batch));
  }
  data::DataPosition current = position;  // of the next batch to train on
  // What the epoch in progress adds up to (training steps only; the
  // evaluation counts with its own).
  TrainingTotals totals(device);
  EpochSoFar epoch_so_far;
  if (resumed_epoch) {
    epoch_so_far = *resumed_epoch;
    totals.resume_epoch(epoch_so_far.sums);
  }
  auto save = [&] {
    if (c.checkpoint.empty() || !lead) return;
    ckpt::Checkpoint snapshot = ckpt::capture(*w.model, *optimizer, step, current, gen);
    snapshot.extra = precision.state_dict();
    epoch_so_far.sums = totals.sums();
    for (const auto& [key, t] : epoch_state(epoch_so_far)) snapshot.extra.insert(key, t);
    snapshot.info = run_record(c, world_size, w.data_identity);
    ckpt::save_checkpoint(c.checkpoint, snapshot);  // into the folder prepare_checkpoint_path made
  };

  // A capturable optimizer keeps its step counts and learning rate on the
  // device (set after --resume has loaded its state).
  if (graph) optimizer->set_capturable(true);

  progress.message(fmt::format("mpt-train: {} on {}, {}, batch {} x {}, {} lr {:g} ({}), {} steps{}", w.description,
                               device.str(), c.precision, c.batch_size, c.accumulation, c.optimizer, c.lr,
                               c.schedule, total_steps, graph ? ", CUDA graph" : ""));
  // Everything a study of the run needs to know about it, in its first line.
  nlohmann::ordered_json scaler_settings = nullptr;  // no loss scaler outside fp16
  if (const amp::GradScaler* scaler = precision.scaler())
    scaler_settings = {{"policy", c.scaler},
                       {"init_scale", scaler->options().init_scale},
                       {"growth_factor", scaler->options().growth_factor},
                       {"backoff_factor", scaler->options().backoff_factor},
                       {"growth_interval", scaler->options().growth_interval}};
  progress.record({{"event", "start"}, {"model", c.model}, {"data", as_utf8(c.data)},
                   {"data_identity", w.data_identity}, {"device", device.str()}, {"precision", c.precision},
                   {"scaler", scaler_settings}, {"batch_size", c.batch_size}, {"accumulation", c.accumulation},
                   {"optimizer", c.optimizer}, {"lr", c.lr}, {"weight_decay", c.weight_decay},
                   {"momentum", c.optimizer == "sgd" ? nlohmann::ordered_json(c.momentum) : nullptr},
                   {"schedule", c.schedule}, {"warmup_steps", c.schedule == "constant" ? 0 : c.warmup_steps},
                   {"min_lr_ratio", c.min_lr_ratio}, {"total_steps", total_steps}, {"seed", c.seed},
                   {"parallel", parallel}, {"world_size", world_size}, {"cuda_graph", graph},
                   {"resumed", saved.has_value()}, {"resumed_from", saved ? nlohmann::ordered_json(as_utf8(c.resume)) : nullptr},
                   {"resumed_at_step", saved ? nlohmann::ordered_json(saved->step) : nullptr},
                   {"mptrain_version", library_version()}});
  progress.record({{"event", "rank"}, {"rank", rank}, {"world_size", world_size}, {"host", host_name()},
                   {"pid", ::getpid()}, {"device", devices_text}});

  // Where this invocation ends: the whole run, or an early stop that a
  // later --resume continues.
  const int64_t last_step = c.stop_after > 0 ? std::min(total_steps, c.stop_after) : total_steps;
  // A signal stops the run after the current step. Ranks of one job must
  // stop after the same step (a rank that went on alone would wait for the
  // others in its next all-reduce), so each rank's request travels with
  // the gathers at logging steps and at each epoch's end, and every rank
  // stops there if any asked: up to --log-every steps after the signal.
  bool stop_agreed = false;
  auto stopping = [&] { return world ? stop_agreed : stop_requested.load(); };
  // A stop before the run's end, by signal or --stop-after: the epoch in
  // progress is neither evaluated nor summed up; its resumption does that.
  // An epoch whose last batch was trained is summed up before the stop, and
  // its resumption starts the next one. A signal after the last step stops
  // nothing: the run ends as it would have.
  auto finished = [&] { return step >= total_steps; };
  auto stopping_early = [&] { return !finished() && (stopping() || step >= last_step); };

  // Diagnostics: the step-time breakdown (on device 0's stream under dp),
  // and on the lead rank a sampler of the GPUs this node's ranks use.
  StepTimer timer(dp ? dp->devices().front() : device);
  StepTimer::Activation timer_active(&timer);
  std::unique_ptr<GpuSampler> sampler_thread;
  if (lead && device.is_cuda()) {
    std::vector<int> gpus;
    if (dp) {
      for (const Device& d : dp->devices()) gpus.push_back(d.index);
    } else if (world) {
      for (int i = 0; i < cuda_device_count(); ++i) gpus.push_back(i);  // one per local rank
    } else {
      gpus.push_back(device.index);
    }
    sampler_thread = std::make_unique<GpuSampler>(
        gpus, std::chrono::milliseconds(1000), [&progress](const nlohmann::ordered_json& r) { progress.record(r); },
        [&progress](const std::string& w) { progress.message(w); });
    if (!sampler_thread->running()) progress.message("mpt-train: GPU sampler off: " + sampler_thread->reason());
  }

  // The model's own step, eager or as a CUDA graph (every step but
  // DataParallel's, which drives several devices).
  std::optional<TrainingStep> train_step;
  if (!dp) train_step.emplace(w, precision, *optimizer, totals, ddp.get(), device, graph);
  bool fallback_reported = false;

  TrainResult result;
  bool evaluated = false;  // by this invocation
  auto evaluate_model = [&] {
    const Evaluation eval = evaluate(w, device, w.sequences ? c.batch_size : 500, c.eval_batches);
    result.eval_loss = eval.loss;
    result.eval_accuracy = eval.accuracy;
    evaluated = true;
    return eval;
  };
  StopOnSignal stop_on_signal;
  for (int64_t epoch = position.epoch; epoch < c.epochs && step < last_step && !stopping(); ++epoch) {
    loader.start_epoch(epoch, epoch == position.epoch ? position.batch : 0);
    progress.start_epoch(epoch, c.epochs, steps_per_epoch);
    const auto epoch_started = Clock::now();
    auto window_started = Clock::now();
    // Steps the loss scaler skipped show as updates missing from the first
    // parameter's count (every model here updates all of its parameters).
    if (!resumed_epoch || epoch != position.epoch) {  // (a resumed epoch's sums are in already)
      epoch_so_far = {{}, step, optimizer->step_count(0)};
      totals.start_epoch();
    }
    int64_t samples = 0, window_samples = 0;  // this invocation's, for its rate
    StepBreakdown epoch_breakdown;
    // A step's micro-batches: `accumulation` of them, fewer at the epoch's
    // end, none after it.
    auto next_group = [&] {
      std::vector<data::Batch> group;
      while (static_cast<int64_t>(group.size()) < c.accumulation && loader.position().batch < batches)
        group.push_back(*loader.next());
      return group;
    };
    // A graphed step takes the next step's batches along, to copy them into
    // its inputs while it runs; `ahead` holds them until their own step.
    std::vector<data::Batch> ahead;
    while (step < last_step && !stopping()) {
      std::vector<data::Batch> micro_batches = ahead.empty() ? next_group() : std::move(ahead);
      ahead.clear();
      if (micro_batches.empty()) break;
      const data::DataPosition after_step = loader.position();
      timer.begin_step();
      schedule.apply(*optimizer, step);
      for (const data::Batch& b : micro_batches) {
        samples += b.size();
        window_samples += b.size();
      }
      if (train_step && train_step->graph() && step + 1 < last_step) ahead = next_group();
      if (!first_batch_reported) {
        const Tensor& input = micro_batches.front().input;
        fmt::print("rank {} of {}: first input batch {}{} on {}{}\n", rank, world_size, dtype_name(input.dtype()),
                   shape_str(input.shape()), dp ? dp->devices().front().str() : device.str(),
                   dp ? ", split over the replicas by DataParallel" : "");
        std::fflush(stdout);
        first_batch_reported = true;
      }
      if (train_step) {
        train_step->run(micro_batches, ahead);
        if (!fallback_reported && !train_step->fallback_reason().empty()) {
          progress.message("mpt-train: the step could not be captured as a CUDA graph and runs eagerly: " +
                           train_step->fallback_reason());
          fallback_reported = true;
        }
      } else {
        timer.lap(StepPhase::data_wait);
        dp_step(*dp, w, precision, *optimizer, totals, micro_batches);
        timer.lap(StepPhase::other);
        {
          NvtxRange range("optimizer");
          precision.step();
        }
        timer.lap(StepPhase::optimizer);
      }
      timer.end_step();
      ++step;
      current = after_step;
      // The host queues steps ahead of the GPU. At logging steps the timer
      // waits for the GPU to finish the window's steps, and the window's
      // time is read after that: it is the GPU's pace, not only the host's.
      const bool logging = step % c.log_every == 0;
      StepBreakdown window;
      if (logging) window = timer.take();
      const double window_seconds = seconds_since(window_started);
      // Under ddp every rank trains its own shard in the same time: the
      // job's rate is the world's multiple of the rank's.
      const double rank_rate = window_samples / std::max(window_seconds, 1e-9);
      const double rate = rank_rate * world_size;
      nlohmann::ordered_json timing = nlohmann::ordered_json::object();
      if (logging) {
        epoch_breakdown.add(window);
        timing = timing_fields(window, 1e3 * window_seconds / std::max<int64_t>(window.steps, 1));
        // The loss scaler's state after the step (the timer waited for the
        // GPU already), and the steps it skipped so far in the run.
        timing["scale"] = precision.scale();
        timing["skipped_steps_in_run"] = step - optimizer->step_count(0);
        if (world) timing["rank_samples_per_s"] = rank_rate;
        if (world) {
          // Ranks wait for each other in communication, so whole steps take
          // equally long; the work outside it shows who is slow. Each rank's
          // stop request goes along.
          const double work = window.total_ms() - window[StepPhase::comm];
          const Tensor mine =
              prim::to(from_vector(std::vector<double>{work, stop_requested ? 1.0 : 0.0}, {2}, DType::f64), device);
          std::vector<Tensor> all;
          for (int r = 0; r < world_size; ++r) all.push_back(zeros({2}, DType::f64, device));
          world->group->allgather(all, mine)->wait();
          std::vector<double> per_rank;
          for (const Tensor& t : all) {
            const std::vector<double> values = t.to_vector<double>();
            per_rank.push_back(values[0]);
            stop_agreed = stop_agreed || values[1] != 0;
          }
          timing["rank_work_ms"] = per_rank;
          if (auto warning = imbalance_warning(per_rank)) progress.message(*warning);
        }
      }
      progress.step(step, current.batch / c.accumulation + (current.batch % c.accumulation != 0 ? 1 : 0),
                    [&totals] { return totals.step_loss(); }, optimizer->lr(), rate, timing);
      if (logging) {
        window_started = Clock::now();
        window_samples = 0;
      }
      if (c.checkpoint_every > 0 && step % c.checkpoint_every == 0) save();
    }
    if (world && !stop_agreed) {
      Tensor asked = full({1}, stop_requested ? 1.0 : 0.0, DType::f32, device);
      world->group->allreduce(asked, dist::ReduceOp::max)->wait();
      stop_agreed = asked.item() != 0;
    }
    if (stopping_early() && current.batch < batches) break;
    epoch_breakdown.add(timer.take());  // waits for the epoch's last step
    const double epoch_seconds = seconds_since(epoch_started);
    const Evaluation eval = evaluate_model();
    nlohmann::ordered_json summary = {{"event", "epoch"},
                              {"epoch", epoch + 1},
                              {"step", step},
                              {"train_loss", totals.mean_loss()},
                              {"train_accuracy", totals.accuracy()},
                              {"eval_loss", eval.loss},
                              {"eval_accuracy", eval.accuracy},
                              {"samples_per_s", world_size * samples / std::max(epoch_seconds, 1e-9)},
                              {"seconds", epoch_seconds},
                              {"scale", precision.scale()},
                              {"skipped_steps", (step - epoch_so_far.first_step) -
                                                    (optimizer->step_count(0) - epoch_so_far.first_update)}};
    if (world) summary["rank_samples_per_s"] = samples / std::max(epoch_seconds, 1e-9);
    if (train_step && train_step->graph()) {
      summary["graph_captures"] = train_step->captures();
      summary["graph_replays"] = train_step->replays();
    }
    const nlohmann::ordered_json epoch_timing =
        timing_fields(epoch_breakdown, 1e3 * epoch_seconds / std::max<int64_t>(epoch_breakdown.steps, 1));
    for (const auto& [k, v] : epoch_timing.items()) summary[k] = v;
    // Every rank samples (the others print nothing), so that none waits in
    // its next all-reduce for rank 0's sample.
    progress.end_epoch(summary);
    text_sampler.sample(step, progress);
  }
  sampler_thread.reset();
  // Nothing was left to train (a finished run resumed, or --steps lowered
  // below the checkpoint's): the end still reports the model's test figures.
  if (finished() && !evaluated) {
    evaluate_model();
    text_sampler.sample(step, progress);
  }
  save();
  result.steps = step;
  result.seconds = seconds_since(started);
  result.stopped_early = stopping_early();
  result.interrupted = result.stopped_early && stopping();
  if (result.stopped_early) {
    progress.record({{"event", "interrupted"}, {"reason", result.interrupted ? "signal" : "stop-after"},
                     {"steps", step}, {"seconds", result.seconds}});
    progress.message(fmt::format("mpt-train: {} after step {}{}",
                                 result.interrupted ? "interrupted" : "stopped (--stop-after)", step,
                                 c.checkpoint.empty() ? "" : fmt::format("; --resume '{}' continues", c.checkpoint)));
  } else {
    progress.record({{"event", "end"}, {"steps", step}, {"eval_loss", result.eval_loss},
                     {"eval_accuracy", result.eval_accuracy}, {"seconds", result.seconds}});
    progress.message(fmt::format("mpt-train: done: {} steps in {:.1f} s, test loss {:.4f}, test accuracy {:.2f}%{}",
                                 step, result.seconds, result.eval_loss, 100 * result.eval_accuracy,
                                 c.checkpoint.empty() ? "" : fmt::format("; checkpoint written to '{}'", c.checkpoint)));
  }
  return result;
}

}  // namespace mpt::train
