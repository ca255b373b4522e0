#pragma once
// The training step and loop a program embeds: a model, an objective (its
// loss), an optimizer and options in; steps with everything mpt-train's
// have out. Mixed precision (autocast, fp32 master weights, fp16's loss
// scaler skipping steps that overflow), gradient accumulation (DDP's
// no_sync for every micro-batch but the last), DDP or DataParallel, a
// CUDA graph of the whole step where it can be (eager steps otherwise,
// with the reason), gradient clipping, a learning-rate schedule, the
// overflow decision agreed across devices and ranks, per-step metrics,
// and checkpoints that capture and restore the whole run in one call, so
// that a stopped run resumed ends bit-identical to an unbroken one.
//
//   auto model = std::make_shared<MyNet>();
//   train::TrainerOptions o;
//   o.step.precision = train::Precision::bf16;
//   train::Trainer trainer(model, std::make_unique<optim::AdamW>(model->parameters()),
//                          train::classification(), o);
//   train::FitOptions fit{.epochs = 2, .accumulation = 2, .checkpoint = "run.safetensors"};
//   trainer.fit(loader, fit, {.on_log = [](const train::StepMetrics& m) { ... }});
//
// or step by step: trainer.step(micro_batches), trainer.metrics(),
// trainer.save(path) / trainer.restore(ckpt::read_checkpoint(path)).
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "models/checkpoint.h"
#include "models/data_loader.h"
#include "models/lr_schedule.h"
#include "models/module.h"
#include "models/optimizer.h"
#include "parallel/data_parallel.h"
#include "parallel/distributed_data_parallel.h"
#include "tensor/random.h"
#include "tensor/step_timer.h"
#include "train/mixed_precision.h"
#include "train/objective.h"
#include "train/options.h"
#include "train/train_step.h"
#include "train/training_totals.h"

namespace mpt::train {

struct TrainerOptions {
  StepOptions step;  // precision, loss scaler, CUDA graph, clipping
  // The model's device (none and ddp; under dp the first replica's).
  Device device = kCPU;
  Parallel parallel = Parallel::none;
  // ddp: the process group (dist::init_process_group's `group`) and DDP's
  // options; or, instead of a group, an existing wrapper of the model (a
  // ReplicaGroup replica's), which the Trainer uses as it is.
  std::shared_ptr<dist::ProcessGroup> group;
  dist::DdpOptions ddp;
  dist::DistributedDataParallel* ddp_wrapper = nullptr;
  // dp: the replicas' devices (the model's first) and how to build a
  // replica of the model (its values are replaced by the model's).
  std::vector<Device> dp_devices;
  dist::ModuleFactory make_replica;
  // The learning rate at each step; none: the optimizer's own.
  std::optional<optim::LrSchedule> schedule;
  // The generator a checkpoint records and restores (its seed and offset):
  // the one that drew the initial weights, say. None: one of the Trainer's.
  Generator* rng = nullptr;
  // ddp: all-reduce fp16's overflow flag, so that every rank skips or takes
  // each step alike. DDP leaves every rank the same averaged gradients, so
  // the ranks find the same overflows anyway; the all-reduce (a small
  // collective per step) guards against ranks whose arithmetic differs.
  bool agree_on_overflow = true;
  // ddp: overlap the last gradient bucket's all-reduce with the optimizer
  // step of the other parameters (DistributedDataParallel::overlap_step_with;
  // without a loss scaler, a disabled one steps the parameters in parts).
  bool overlap_step = false;
  // The step-time breakdown (StepMetrics::timing): timing events at each
  // phase. Off for a caller that times whole steps itself.
  bool time_steps = true;
  // The step's mean loss and the epoch's sums (its loss, and a classifier's
  // right predictions) counted on the device: a few small kernels a step.
  // Off for a benchmark of the bare step: the loss reported is then the
  // last micro-batch's, and the epoch's sums stay 0.
  bool count_totals = true;
};

// The steps a run plans for: `epochs` over `batches_per_epoch` batches,
// `accumulation` of them to a step (an epoch's last step may take fewer),
// at most max_steps where that is above 0. Counted without overflow.
int64_t planned_steps(int64_t batches_per_epoch, int64_t epochs, int64_t accumulation, int64_t max_steps = 0);

// Why a step on `device` under `parallel` cannot be captured as a CUDA
// graph ("the run is on cpu, not a GPU"); empty where it can.
std::string graph_obstacle(const Device& device, Parallel parallel);

// What the run looks like after its latest step. Reading them waits for the
// device (a GPU's queued steps), so read them at logging steps.
struct StepMetrics {
  int64_t step = 0;           // optimizer steps taken in the run (a resumed run's earlier ones included)
  double loss = 0;            // the latest step's loss (the mean over its micro-batches)
  double lr = 0;              // the learning rate the latest step used
  double scale = 1;           // the loss scale after it (1 without a scaler)
  int64_t skipped_steps = 0;  // steps the loss scaler skipped since the run began
  StepBreakdown timing;       // mean ms per phase over the steps since the last metrics()
  int64_t samples = 0;        // trained since the last metrics() (this rank's)
  double seconds = 0;         // wall-clock time since the last metrics() (or the epoch's start in fit())
  std::vector<double> rank_work_ms;  // fit() under ddp: each rank's ms per step without communication
};

// An epoch's training steps added up (fit()'s callback at an epoch's end).
struct EpochMetrics {
  int64_t epoch = 0;           // counted from 0
  int64_t step = 0;            // the run's steps at its end
  double train_loss = 0;       // per prediction, as the model was when it saw each batch
  double train_accuracy = 0;   // classifiers (0 otherwise)
  int64_t skipped_steps = 0;   // in this epoch
  int64_t samples = 0;         // trained in this invocation (a resumed epoch's earlier part not counted)
  double seconds = 0;          // this invocation's part of the epoch
  StepBreakdown timing;        // over the epoch's steps
};

struct Evaluation {
  double loss = 0, accuracy = 0;
};

struct FitOptions {
  int64_t epochs = 1;
  int64_t max_steps = 0;       // the run's last step (0: all epochs)
  int64_t stop_after = 0;      // end this invocation after this step of the run, as a stop does (0: off)
  int64_t accumulation = 1;    // micro-batches per optimizer step
  int64_t log_every = 100;     // on_log every N steps (under ddp: the ranks' stop requests meet there too)
  std::string checkpoint;      // written at the end, at a stop and every checkpoint_every steps (rank 0)
  int64_t checkpoint_every = 0;
  io::Metadata checkpoint_info;  // the caller's entries in every checkpoint's metadata
};

struct FitCallbacks {
  std::function<void(const StepMetrics&)> on_log;   // every log_every steps
  std::function<void(const std::vector<data::Batch>&)> before_step;  // a step's micro-batches, before it runs
  std::function<void(int64_t step)> on_step;        // after every step (the host's view: no waiting)
  std::function<void(const EpochMetrics&)> on_epoch;  // after an epoch's last step
  // Polled after every step: true ends the run after the current step,
  // with a checkpoint (under ddp every rank stops after the same step: the
  // requests travel with the ranks' gathers at logging steps and epoch ends).
  std::function<bool()> stop_requested;
};

struct FitResult {
  int64_t steps = 0;            // the run's steps at the end
  int64_t total_steps = 0;      // what the run plans for
  bool finished = false;        // every step of the run is done
  bool stopped = false;         // by stop_requested
  bool evaluated_epoch = false; // an on_epoch came in this invocation
};

class Trainer {
 public:
  Trainer(std::shared_ptr<nn::Module> model, std::unique_ptr<optim::Optimizer> optimizer, Objective objective,
          TrainerOptions options = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // One optimizer step over `micro_batches` (their gradients averaged),
  // with the schedule's learning rate for this step. `next`: the next
  // step's micro-batches where known (a graphed step copies them in beside
  // its own end).
  void step(const std::vector<data::Batch>& micro_batches, const std::vector<data::Batch>& next = {});
  // The run after its latest step (waits for the device).
  StepMetrics metrics();
  // The latest step's loss (waits for the device).
  double last_loss() const;

  // Trains over the loader's epochs from the run's current place (a
  // restored checkpoint's), in steps of `accumulation` micro-batches.
  FitResult fit(data::DataLoader& loader, const FitOptions& options, const FitCallbacks& callbacks = {});

  // Mean loss and accuracy over a data set (every stride-th sample, at most
  // max_batches batches; 0: all), in eval mode and without gradients, on
  // the model's device.
  Evaluation evaluate(const data::Dataset& data, int64_t batch_size, int64_t max_batches = 0,
                      int64_t stride = 1) const;

  // The whole run in one checkpoint: model, optimizer, the loss scaler,
  // the step (the schedule's place), the data position, the generator, the
  // epoch's sums so far, and `info` in its metadata.
  ckpt::Checkpoint capture(const io::Metadata& info = {}) const;
  // Writes capture(info) atomically (ckpt::save_checkpoint).
  void save(const std::string& path, const io::Metadata& info = {}) const;
  // Restores everything capture() took, all or nothing (the scaler's state
  // and the epoch's sums are checked before the model is touched).
  // `source` names the checkpoint in errors.
  void restore(const ckpt::Checkpoint& checkpoint, const std::string& source = "checkpoint");

  nn::Module& model() { return *model_; }
  optim::Optimizer& optimizer() { return *optimizer_; }
  MixedPrecision& precision() { return *precision_; }
  TrainingTotals& totals() { return *totals_; }
  const TrainerOptions& options() const { return options_; }
  dist::DistributedDataParallel* ddp() { return ddp_; }
  dist::DataParallel* data_parallel() { return dp_.get(); }
  const Device& device() const { return options_.device; }

  int64_t steps() const { return steps_; }
  const data::DataPosition& position() const { return position_; }
  void set_position(const data::DataPosition& position) { position_ = position; }

  // The CUDA graph: whether the step is recorded as one, why not where
  // GraphMode::automatic left it eager (empty otherwise), and why capturing
  // failed where it was tried (the steps then run eagerly).
  bool graph() const { return step_->graph(); }
  const std::string& graph_obstacle() const { return graph_obstacle_; }
  std::string graph_fallback_reason() const { return step_->fallback_reason(); }
  int64_t graph_replays() const { return step_->replays(); }
  int64_t graph_captures() const { return step_->captures(); }
  TrainStep& train_step() { return *step_; }

 private:
  // Where the epoch in progress began: its sums are the totals', its
  // skipped steps the updates missing from the first parameter's count.
  struct EpochStart {
    int64_t step = 0;
    int64_t update = 0;
  };
  void start_epoch();
  // Under ddp: whether any rank asked to stop, gathered with each rank's
  // work time at a logging step (`work_ms`, filled) or alone.
  bool agree_on_stop(bool mine, std::vector<double>* work_ms, double my_work_ms);

  std::shared_ptr<nn::Module> model_;
  std::unique_ptr<optim::Optimizer> optimizer_;
  Objective objective_;
  TrainerOptions options_;
  std::unique_ptr<dist::DistributedDataParallel> owned_ddp_;
  dist::DistributedDataParallel* ddp_ = nullptr;
  std::unique_ptr<dist::DataParallel> dp_;
  std::unique_ptr<MixedPrecision> precision_;
  std::unique_ptr<TrainingTotals> totals_;
  std::unique_ptr<TrainStep> step_;
  std::unique_ptr<StepTimer> timer_;
  std::string graph_obstacle_;
  Generator own_rng_{0};
  Generator* rng_;

  int64_t steps_ = 0;
  data::DataPosition position_;  // of the next batch to train on
  EpochStart epoch_start_;
  bool resumed_mid_epoch_ = false;  // restore() brought an epoch's sums
  // Since the last metrics().
  int64_t window_samples_ = 0;
  std::chrono::steady_clock::time_point window_started_ = std::chrono::steady_clock::now();
};

}  // namespace mpt::train
