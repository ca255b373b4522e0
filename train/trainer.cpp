#include "train/trainer.h"

#include <cmath>
#include <iterator>
#include <limits>

#include "autograd/grad_mode.h"
#include "models/training_mode.h"
#include "tensor/ops.h"

namespace mpt::train {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The epoch in progress at a checkpoint: what its steps so far add up to
// and where it began, kept in the checkpoint's extra tensors ("epoch.*"),
// so that a resumed run sums up the whole epoch, not only its part.
constexpr const char* kEpochKeys[] = {"epoch.loss_sum", "epoch.correct", "epoch.predictions", "epoch.first_step",
                                      "epoch.first_update"};

struct SavedEpoch {
  TrainingTotals::Sums sums;
  int64_t first_step = 0, first_update = 0;
};

// Nothing from a checkpoint without these entries.
std::optional<SavedEpoch> read_epoch_state(const OrderedDict<Tensor>& state, const std::string& source) {
  if (state.empty()) return std::nullopt;
  double values[std::size(kEpochKeys)];
  for (size_t i = 0; i < std::size(kEpochKeys); ++i) {
    const Tensor* t = state.find(kEpochKeys[i]);
    check(t && t->numel() == 1, "{}: the checkpoint's epoch totals lack '{}'", source, kEpochKeys[i]);
    values[i] = t->item();
    check(std::isfinite(values[i]) && values[i] >= 0, "{}: the checkpoint's '{}' is {}, not a count", source,
          kEpochKeys[i], values[i]);
  }
  check(state.size() == std::size(kEpochKeys), "{}: unexpected epoch entries in the checkpoint", source);
  return SavedEpoch{{values[0], values[1], static_cast<int64_t>(values[2])},
                    static_cast<int64_t>(values[3]),
                    static_cast<int64_t>(values[4])};
}

}  // namespace

int64_t planned_steps(int64_t batches_per_epoch, int64_t epochs, int64_t accumulation, int64_t max_steps) {
  check(batches_per_epoch >= 0 && epochs >= 0 && accumulation >= 1 && max_steps >= 0,
        "planned_steps: {} batches, {} epochs, accumulation {}, max_steps {}", batches_per_epoch, epochs,
        accumulation, max_steps);
  const int64_t per_epoch = batches_per_epoch / accumulation + (batches_per_epoch % accumulation != 0 ? 1 : 0);
  constexpr int64_t kMaxSteps = std::numeric_limits<int64_t>::max();
  const int64_t all_epochs = per_epoch > 0 && epochs > kMaxSteps / per_epoch ? kMaxSteps : epochs * per_epoch;
  return max_steps > 0 ? std::min(max_steps, all_epochs) : all_epochs;
}

std::string graph_obstacle(const Device& device, Parallel parallel) {
  if (!device.is_cuda()) return fmt::format("the run is on {}, not a GPU", device.str());
  if (parallel == Parallel::dp) return "DataParallel drives every GPU from one step";
  return "";
}

Trainer::Trainer(std::shared_ptr<nn::Module> model, std::unique_ptr<optim::Optimizer> optimizer, Objective objective,
                 TrainerOptions options)
    : model_(std::move(model)),
      optimizer_(std::move(optimizer)),
      objective_(std::move(objective)),
      options_(std::move(options)),
      rng_(options_.rng ? options_.rng : &own_rng_) {
  check(model_ != nullptr && optimizer_ != nullptr, "Trainer: needs a model and an optimizer");
  const StepOptions& s = options_.step;
  check(s.max_grad_norm >= 0 && std::isfinite(s.max_grad_norm),
        "Trainer: max_grad_norm must be finite and not negative (0: no clipping), got {}", s.max_grad_norm);
  Placement placement{options_.device};
  if (options_.parallel == Parallel::ddp) {
    if (options_.ddp_wrapper) {
      ddp_ = options_.ddp_wrapper;
    } else {
      check(options_.group != nullptr,
            "Trainer: Parallel::ddp needs a process group (TrainerOptions::group, from dist::init_process_group) or a "
            "DDP wrapper of the model");
      owned_ddp_ = std::make_unique<dist::DistributedDataParallel>(model_, options_.group, options_.ddp);
      ddp_ = owned_ddp_.get();
    }
    placement.ddp = ddp_;
  } else if (options_.parallel == Parallel::dp) {
    check(!options_.dp_devices.empty() && options_.make_replica != nullptr,
          "Trainer: Parallel::dp needs the replicas' devices (TrainerOptions::dp_devices) and a replica factory "
          "(make_replica)");
    options_.device = options_.dp_devices.front();
    dp_ = std::make_unique<dist::DataParallel>(model_, options_.make_replica, options_.dp_devices);
    placement = {options_.device, nullptr, dp_.get()};
  }
  StepOptions precision_options = s;
  const bool scaled = s.loss_scaling == LossScaling::always ||
                      (s.loss_scaling == LossScaling::automatic && s.precision == Precision::fp16);
  check(!options_.overlap_step || ddp_, "Trainer: overlap_step needs Parallel::ddp");
  if (options_.overlap_step && !scaled) {
    // A disabled scaler scales nothing but still steps in parts.
    precision_options.loss_scaling = LossScaling::always;
    precision_options.scaler.enabled = false;
  }
  precision_ = std::make_unique<MixedPrecision>(precision_options, *optimizer_, options_.device.type);
  if (s.precision == Precision::fp8) {
    // DataParallel's replicas are copies made per step, each of which would
    // need the scales of the one model.
    check(!dp_, "Trainer: fp8 runs on one device or under DDP, not DataParallel");
    precision_->attach_fp8(*model_, options_.device);
    // Every rank derives its scales from the same (all-reduced) amaxes, so
    // the replicas quantize alike and stay identical.
    if (ddp_) precision_->set_fp8_amax_reducer([this](Tensor& amax) { ddp_->group().allreduce(amax, dist::ReduceOp::max)->wait(); });
  }
  if (options_.overlap_step) ddp_->overlap_step_with(*precision_->scaler());
  if (ddp_ && options_.agree_on_overflow)
    if (amp::GradScaler* scaler = precision_->scaler())
      scaler->set_found_inf_reducer([this](Tensor& found_inf) { ddp_->allreduce_found_inf(found_inf); });

  graph_obstacle_ = train::graph_obstacle(options_.device, options_.parallel);
  check(s.cuda_graph != GraphMode::on || graph_obstacle_.empty(), "Trainer: the step cannot be a CUDA graph: {}",
        graph_obstacle_);
  const bool graph = s.cuda_graph != GraphMode::off && graph_obstacle_.empty();
  if (s.cuda_graph == GraphMode::off) graph_obstacle_.clear();
  // A capturable optimizer keeps its step counts and learning rate on the
  // device, so that the step reads nothing back to the host.
  if (graph) optimizer_->set_capturable(true);
  totals_ = std::make_unique<TrainingTotals>(options_.device);
  step_ = std::make_unique<TrainStep>(*model_, objective_, *optimizer_, *precision_,
                                      options_.count_totals ? totals_.get() : nullptr, placement, s.max_grad_norm,
                                      graph);
  if (options_.time_steps) timer_ = std::make_unique<StepTimer>(options_.device);
  totals_->start_epoch();
}

Trainer::~Trainer() = default;

void Trainer::step(const std::vector<data::Batch>& micro_batches, const std::vector<data::Batch>& next) {
  StepTimer::Activation active(timer_.get());
  if (timer_) timer_->begin_step();
  if (options_.schedule) options_.schedule->apply(*optimizer_, steps_);
  for (const data::Batch& b : micro_batches) window_samples_ += b.size();
  step_->run(micro_batches, next);
  if (timer_) timer_->end_step();
  ++steps_;
}

StepMetrics Trainer::metrics() {
  StepMetrics m;
  if (timer_) m.timing = timer_->take();  // waits for the GPU to pass the window's steps
  m.step = steps_;
  m.loss = last_loss();
  m.lr = optimizer_->lr();
  m.scale = precision_->scale();
  // A skipped step shows as an update missing from the first parameter's
  // count (a model whose every parameter trains).
  m.skipped_steps = steps_ - optimizer_->step_count(0);
  m.samples = window_samples_;
  m.seconds = seconds_since(window_started_);
  window_samples_ = 0;
  window_started_ = Clock::now();
  return m;
}

double Trainer::last_loss() const {
  return options_.count_totals ? totals_->step_loss() : step_->last_loss();
}

void Trainer::start_epoch() {
  totals_->start_epoch();
  epoch_start_ = {steps_, optimizer_->step_count(0)};
}

bool Trainer::agree_on_stop(bool mine, std::vector<double>* work_ms, double my_work_ms) {
  dist::ProcessGroup& group = *options_.group;
  const Device& device = options_.device;
  if (!work_ms) {
    Tensor asked = full({1}, mine ? 1.0 : 0.0, DType::f32, device);
    group.allreduce(asked, dist::ReduceOp::max)->wait();
    return asked.item() != 0;
  }
  const Tensor own = prim::to(from_vector(std::vector<double>{my_work_ms, mine ? 1.0 : 0.0}, {2}, DType::f64), device);
  std::vector<Tensor> all;
  for (int r = 0; r < group.size(); ++r) all.push_back(zeros({2}, DType::f64, device));
  group.allgather(all, own)->wait();
  bool any = false;
  work_ms->clear();
  for (const Tensor& t : all) {
    const std::vector<double> values = t.to_vector<double>();
    work_ms->push_back(values[0]);
    any = any || values[1] != 0;
  }
  return any;
}

FitResult Trainer::fit(data::DataLoader& loader, const FitOptions& o, const FitCallbacks& callbacks) {
  check(o.epochs >= 1 && o.accumulation >= 1 && o.log_every >= 1 && o.max_steps >= 0 && o.stop_after >= 0 &&
            o.checkpoint_every >= 0,
        "Trainer::fit: epochs {}, accumulation {} and log_every {} must be positive, max_steps {}, stop_after {} and "
        "checkpoint_every {} not negative",
        o.epochs, o.accumulation, o.log_every, o.max_steps, o.stop_after, o.checkpoint_every);
  const int64_t batches = loader.batches_per_epoch();
  FitResult result;
  result.total_steps = planned_steps(batches, o.epochs, o.accumulation, o.max_steps);
  const int64_t total = result.total_steps;
  // Where this invocation ends: the whole run, or an early stop that a
  // restore() of its checkpoint continues.
  const int64_t last_step = o.stop_after > 0 ? std::min(total, o.stop_after) : total;
  const bool lead = !options_.group || options_.group->rank() == 0;
  auto save_checkpoint = [&] {
    if (!o.checkpoint.empty() && lead) save(o.checkpoint, o.checkpoint_info);
  };

  // A checkpoint saved after an epoch's last batch (summed up before that
  // stop) goes on with the next epoch.
  if (position_.batch >= batches) position_ = {position_.epoch + 1, 0};
  const bool resumed_epoch = resumed_mid_epoch_ && position_.batch > 0;
  resumed_mid_epoch_ = false;

  // A stop request ends the run after the current step. Ranks of one job
  // must stop after the same step (a rank that went on alone would wait for
  // the others in its next all-reduce), so under ddp each rank's request
  // travels with the gathers at logging steps and at each epoch's end, and
  // every rank stops there if any asked.
  const bool distributed = options_.group && options_.group->size() > 1;
  bool stop_agreed = false;
  auto asked = [&] { return callbacks.stop_requested && callbacks.stop_requested(); };
  auto stopping = [&] { return distributed ? stop_agreed : asked(); };
  auto finished = [&] { return steps_ >= total; };
  // A stop before the run's end: the epoch in progress is neither summed
  // up nor reported; its resumption does that. An epoch whose last batch
  // was trained is summed up before the stop.
  auto stopping_early = [&] { return !finished() && (stopping() || steps_ >= last_step); };

  for (int64_t epoch = position_.epoch; epoch < o.epochs && steps_ < last_step && !stopping(); ++epoch) {
    loader.start_epoch(epoch, epoch == position_.epoch ? position_.batch : 0);
    if (!resumed_epoch || epoch != position_.epoch) start_epoch();  // (a resumed epoch's sums are in already)
    const auto epoch_started = Clock::now();
    window_started_ = epoch_started;  // the rate's window starts with the epoch's first batch
    window_samples_ = 0;
    int64_t samples = 0;
    StepBreakdown epoch_timing;
    // A step's micro-batches: `accumulation` of them, fewer at the epoch's
    // end, none after it.
    auto next_group = [&] {
      std::vector<data::Batch> group;
      while (static_cast<int64_t>(group.size()) < o.accumulation && loader.position().batch < batches)
        group.push_back(*loader.next());
      return group;
    };
    // A graphed step takes the next step's batches along, to copy them into
    // its inputs while it runs; `ahead` holds them until their own step.
    std::vector<data::Batch> ahead;
    while (steps_ < last_step && !stopping()) {
      std::vector<data::Batch> micro_batches = ahead.empty() ? next_group() : std::move(ahead);
      ahead.clear();
      if (micro_batches.empty()) break;
      const data::DataPosition after_step = loader.position();
      for (const data::Batch& b : micro_batches) samples += b.size();
      if (step_->graph() && steps_ + 1 < last_step) ahead = next_group();
      if (callbacks.before_step) callbacks.before_step(micro_batches);
      step(micro_batches, ahead);
      position_ = after_step;
      if (callbacks.on_step) callbacks.on_step(steps_);
      if (steps_ % o.log_every == 0) {
        // The timer waits for the window's steps: the metrics are the
        // GPU's pace, not only the host's.
        StepMetrics m = metrics();
        epoch_timing.add(m.timing);
        // Ranks wait for each other in communication, so whole steps take
        // equally long; the work outside it shows who is slow.
        if (distributed)
          stop_agreed = agree_on_stop(asked(), &m.rank_work_ms, m.timing.total_ms() - m.timing[StepPhase::comm]);
        if (callbacks.on_log) callbacks.on_log(m);
      }
      if (o.checkpoint_every > 0 && steps_ % o.checkpoint_every == 0) save_checkpoint();
    }
    if (distributed && !stop_agreed) stop_agreed = agree_on_stop(asked(), nullptr, 0);
    if (stopping_early() && position_.batch < batches) break;
    if (timer_) epoch_timing.add(timer_->take());  // waits for the epoch's last step
    EpochMetrics e;
    e.epoch = epoch;
    e.step = steps_;
    e.train_loss = totals_->mean_loss();
    e.train_accuracy = totals_->accuracy();
    e.skipped_steps = (steps_ - epoch_start_.step) - (optimizer_->step_count(0) - epoch_start_.update);
    e.samples = samples;
    e.seconds = seconds_since(epoch_started);
    e.timing = epoch_timing;
    result.evaluated_epoch = true;
    if (callbacks.on_epoch) callbacks.on_epoch(e);
  }
  result.steps = steps_;
  result.finished = finished();
  result.stopped = stopping_early() && stopping();
  save_checkpoint();
  return result;
}

Evaluation Trainer::evaluate(const data::Dataset& data, int64_t batch_size, int64_t max_batches,
                             int64_t stride) const {
  check(batch_size >= 1 && max_batches >= 0 && stride >= 1,
        "Trainer::evaluate: batch_size {} and stride {} must be positive, max_batches {} not negative", batch_size,
        stride, max_batches);
  NoGradGuard no_grad;
  nn::EvalModeGuard eval_mode(*model_);
  std::vector<int64_t> samples;
  for (int64_t i = 0; i < data.size(); i += stride) samples.push_back(i);
  // Counted on the device: the batches follow each other without waiting
  // for the GPU, which is read once at the end.
  TrainingTotals totals(options_.device);
  totals.start_epoch();
  int64_t done = 0;
  for (size_t first = 0; first < samples.size() && (max_batches == 0 || done < max_batches);
       first += static_cast<size_t>(batch_size), ++done) {
    const size_t last = std::min(samples.size(), first + static_cast<size_t>(batch_size));
    const data::Batch b = data.get_batch(std::vector<int64_t>(samples.begin() + first, samples.begin() + last));
    const Tensor target = prim::to(b.target, options_.device);
    const Tensor out = model_->forward(objective_.model_input(prim::to(b.input, options_.device)));
    totals.count(Objective::predictions(target));
    totals.add(objective_.loss(out, target), Objective::predictions(target), 1.0);
    if (objective_.classification) totals.add_correct(out, target);
  }
  return {totals.mean_loss(), totals.accuracy()};
}

ckpt::Checkpoint Trainer::capture(const io::Metadata& info) const {
  ckpt::Checkpoint c = ckpt::capture(*model_, *optimizer_, steps_, position_, *rng_);
  c.extra = precision_->state_dict();
  const TrainingTotals::Sums sums = totals_->sums();
  const double values[] = {sums.loss, sums.correct, static_cast<double>(sums.predictions),
                           static_cast<double>(epoch_start_.step), static_cast<double>(epoch_start_.update)};
  for (size_t i = 0; i < std::size(kEpochKeys); ++i) c.extra.insert(kEpochKeys[i], scalar_tensor(values[i], DType::f64));
  c.info = info;
  return c;
}

void Trainer::save(const std::string& path, const io::Metadata& info) const {
  ckpt::save_checkpoint(path, capture(info));
}

void Trainer::restore(const ckpt::Checkpoint& checkpoint, const std::string& source) {
  OrderedDict<Tensor> scaler_state, epoch_entries;
  for (const auto& [key, t] : checkpoint.extra)
    (key.rfind("epoch.", 0) == 0 ? epoch_entries : scaler_state).insert(key, t);
  const std::optional<SavedEpoch> saved_epoch = read_epoch_state(epoch_entries, source);
  try {
    precision_->load_state_dict(scaler_state);  // all or nothing, before the model is touched
  } catch (const ValueError& e) {
    throw ValueError(fmt::format("{}: {}", source, e.what()));
  }
  // The optimizer's state loads into host step counts; a capturable one
  // then takes them back to the device.
  const bool capturable = optimizer_->capturable();
  if (capturable) optimizer_->set_capturable(false);
  ckpt::restore(checkpoint, *model_, *optimizer_, *rng_, source);
  if (capturable) optimizer_->set_capturable(true);
  step_->reset_graph();  // its buffers are the restored ones now
  steps_ = checkpoint.step;
  position_ = checkpoint.position;
  resumed_mid_epoch_ = saved_epoch.has_value();
  if (saved_epoch) {
    totals_->resume_epoch(saved_epoch->sums);
    epoch_start_ = {saved_epoch->first_step, saved_epoch->first_update};
  } else {
    start_epoch();
  }
}

}  // namespace mpt::train
