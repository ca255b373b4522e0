// mpt-bench: the reference workloads of PyTorch's torch_bench.py (kept
// beside the checkout, in ../shared/reference/) with the same shapes, batch
// sizes, optimizer, precision and step, timed with CUDA events: warm-up
// steps, then the median of the timed ones. Prints one JSON line per run in
// torch_bench.py's form, plus peak GPU memory.
//
// Modes, as torch_bench.py has them:
//   single  one GPU;
//   dp      every GPU of this process (ReplicaGroup: a thread and a replica
//           per GPU), the per-GPU batch times the GPU count fed from cuda:0
//           (as nn.DataParallel is fed);
//   ddp     one process per GPU through mpt-run, the same per-GPU batch
//           (weak scaling). Started without mpt-run's variables, mpt-bench
//           starts itself through mpt-run.
// And one of its own: allreduce, the time of one all-reduce over every GPU
// by size and way (allreduce_sweep.h).
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "autograd/beside.h"
#include "autograd/engine.h"
#include "autograd/ops.h"
#include "models/adamw.h"
#include "models/cnn.h"
#include "models/gpt.h"
#include "models/mlp.h"
#include "parallel/device_routed_group.h"
#include "parallel/distributed_data_parallel.h"
#include "parallel/replica_group.h"
#include "tensor/backend_settings.h"
#include "tensor/device_guard.h"
#include "tensor/gpu_timeline.h"
#include "tensor/graph.h"
#include "tensor/memory.h"
#include "tensor/ops.h"
#include "tensor/stream.h"
#include "tools/cli_checks.h"
#include "tools/mpt-bench/allreduce_sweep.h"
#include "tools/mpt-bench/gemm_ceiling.h"
#include "tools/mpt-bench/median.h"
#include "train/trainer.h"

namespace {

using namespace mpt;
using mpt::bench::median;

struct Options {
  std::string workload = "mlp_small";
  std::string mode = "single";
  std::string precision = "fp16";
  int warmup = 20;
  int steps = 100;
  int64_t batch = 0;
  int device = 0;
  bool graph = true;
  bool memory_trace = false;
  bool timeline = false;  // print the last step's GPU timeline
  bool cast_weights_ahead = true;  // autocast's weight casts in one launch before forward
  bool fp8_copies_in_optimizer = false;  // fp8: the weights' FP8 copies written by AdamW's step
  bool fp8_fused_mlp = true;             // fp8: GPT's MLP as one amp::fp8_mlp
  dist::DdpOptions ddp;  // dp and ddp: the gradient buckets
  bool overlap_step = false;  // dp and ddp: the last bucket's all-reduce beside the optimizer step
  bool peer_collectives = false;  // dp and ddp: the buckets all-reduced by PeerAllReduce
};

struct Workload {
  std::shared_ptr<nn::Module> model;
  Tensor x, y;
  bool sequence = false;  // logits [B, T, V]: flatten for the loss
  double model_flops = 0;  // GPT: a step's matrix-multiply FLOPs, as MFU counts them
};

Tensor random_labels(int64_t n, int64_t classes, const Shape& shape, std::mt19937_64& rng, const Device& d) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t& t : v) t = static_cast<int64_t>(rng() % static_cast<uint64_t>(classes));
  return prim::to(from_vector(v, shape, DType::i64), d);
}

// The workload's model (seeded like every replica) and one batch of
// `copies` times the per-GPU batch, all on `device`.
Workload make(const std::string& name, const Device& device, int64_t batch, int64_t copies = 1) {
  Generator gen(0);
  std::mt19937_64 rng(0);
  Workload w;
  auto rows = [&](int64_t standard) { return (batch ? batch : standard) * copies; };
  if (name == "mlp_small") {
    const int64_t b = rows(256);
    w.model = nn::make_mlp({}, &gen);
    w.x = randn({b, 784}, DType::f32, kCPU, &gen);
    w.y = random_labels(b, 10, {b}, rng, device);
  } else if (name == "mlp_large") {
    const int64_t b = rows(8192);
    w.model = nn::make_mlp({8192, {8192, 8192, 8192}, 10}, &gen);
    w.x = randn({b, 8192}, DType::f32, kCPU, &gen);
    w.y = random_labels(b, 10, {b}, rng, device);
  } else if (name == "cnn" || name == "cnn_bn") {  // cnn_bn: a BatchNorm2d after each convolution
    const int64_t b = rows(512);
    nn::CNNOptions options;
    options.batch_norm = name == "cnn_bn";
    w.model = nn::make_cnn(options, &gen);
    w.x = randn({b, 1, 28, 28}, DType::f32, kCPU, &gen);
    w.y = random_labels(b, 10, {b}, rng, device);
  } else if (name == "gpt_mini" || name == "gpt2_124m") {
    const bool small = name == "gpt_mini";
    const nn::GPTOptions options = small ? nn::GPTOptions{} : nn::gpt2_small_options();
    const int64_t b = rows(small ? 64 : 16), T = options.context, V = options.vocab_size;
    auto gpt = std::make_shared<nn::GPT>(options, &gen);
    w.model_flops = gpt->training_flops_per_token(T) * static_cast<double>(b * T);
    w.model = gpt;
    w.x = random_labels(b * T, V, {b, T}, rng, kCPU);
    w.y = random_labels(b * T, V, {b, T}, rng, device);
    w.sequence = true;
  } else {
    throw ValueError("mpt-bench: unknown workload '" + name +
                     "' (mlp_small, mlp_large, cnn, cnn_bn, gpt_mini, gpt2_124m)");
  }
  w.model->to(device);
  w.x = prim::to(w.x, device);
  return w;
}

double mib(uint64_t bytes) { return static_cast<double>(bytes) / 1048576.0; }

// The step every mode times: the library's Trainer with the reference's
// optimizer (AdamW lr 1e-4), autocast and the loss scaler, on `device`,
// replayed as a CUDA graph unless --no-graph. As torch_bench.py's step, it
// counts no epoch totals and keeps only the loss, the benchmark times whole
// steps itself (no step-time breakdown), and it does not all-reduce the
// overflow flag (DDP leaves every rank the same averaged gradients, so
// every rank finds the same overflows).
std::unique_ptr<train::Trainer> make_trainer(const Options& o, std::shared_ptr<nn::Module> model, const Device& device,
                                             dist::DistributedDataParallel* ddp = nullptr) {
  train::TrainerOptions t;
  t.step.precision = train::precision_from_name(o.precision);
  t.step.cuda_graph = o.graph ? train::GraphMode::on : train::GraphMode::off;
  t.step.cast_weights_ahead = o.cast_weights_ahead;
  t.step.fp8_copies_in_optimizer = o.fp8_copies_in_optimizer;
  t.step.fp8_fused_mlp = o.fp8_fused_mlp;
  t.device = device;
  t.time_steps = false;
  t.count_totals = false;
  if (ddp) {
    t.parallel = train::Parallel::ddp;
    t.ddp_wrapper = ddp;
    t.agree_on_overflow = false;
    t.overlap_step = o.overlap_step;
  }
  auto optimizer = std::make_unique<optim::AdamW>(model->parameters(), optim::AdamWOptions{1e-4, 0.9, 0.999, 1e-8, 1e-2});
  auto trainer = std::make_unique<train::Trainer>(model, std::move(optimizer), train::classification(), t);
  // The reference's batch is the same every step: read where it lies.
  trainer->train_step().read_inputs_in_place();
  return trainer;
}

// Times warm-up + timed steps with CUDA events around each step and returns
// the timed ones (ms). Every step trains on `batch`; one that lives on
// another device is copied for each step (as nn.DataParallel scatters each
// step's), beside the step before it when the step is a graph.
std::vector<double> time_steps(const Options& o, train::Trainer& t, const data::Batch& batch) {
  const Device& device = t.device();
  std::unique_ptr<GpuTimeline> timeline;
  if (o.timeline) timeline = std::make_unique<GpuTimeline>(device);
  GpuTimeline::Activation timing_points(timeline.get());
  std::vector<double> times;
  Event start(device, true), end(device, true);
  for (int i = 0; i < o.warmup + o.steps; ++i) {
    if (timeline) timeline->begin_step();
    start.record();
    t.step({batch}, {batch});
    end.record();
    end.synchronize();
    if (i >= o.warmup) times.push_back(start.elapsed_ms(end));
  }
  if (timeline)
    for (const auto& [label, us] : timeline->read())
      std::cerr << fmt::format("timeline {}: {:9.1f} us  {}\n", device.str(), us, label);
  if (o.graph && t.graph_replays() == 0)
    std::cerr << "mpt-bench: the step could not be captured: " << t.graph_fallback_reason() << "\n";
  return times;
}

bool graphed(const train::Trainer& t) { return t.graph() && t.graph_replays() > 0; }

// `rank_medians`: each rank's (dp: each replica's) own median, when there
// are several; `med` is the slowest of them.
void print_result(const Options& o, const std::string& mode, int gpus, int64_t batch, double med,
                  const std::vector<double>& times, double loss, double peak_mb, bool graphed,
                  const std::vector<double>& rank_medians = {}, const std::string& extra = "") {
  const double lo = *std::min_element(times.begin(), times.end());
  const double hi = *std::max_element(times.begin(), times.end());
  // Written by hand so the figures keep their rounding (a JSON library
  // prints a double's full expansion).
  std::cout << fmt::format(
                   "{{\"workload\": \"{}\", \"mode\": \"{}\", \"gpus\": {}, \"precision\": \"{}\", \"batch\": {}, "
                   "\"step_ms_median\": {:.4f}, \"step_ms_min\": {:.4f}, \"step_ms_max\": {:.4f}, "
                   "\"samples_per_s\": {:.1f}, \"loss\": {}, \"peak_mem_mb\": {:.1f}, \"cuda_graph\": {}, "
                   "\"grad_transit\": \"{}\", \"registered_buffers\": {}, \"peer_collectives\": {}, \"overlap_step\": {}, "
                   "{}{}\"impl\": \"mptrain\"}}",
                   o.workload, mode, gpus, o.precision, batch, med, lo, hi, batch / med * 1e3, loss, peak_mb,
                   graphed ? "true" : "false", o.ddp.compression ? dtype_name(*o.ddp.compression) : "f32",
                   o.ddp.registered_buffers ? "true" : "false", o.peer_collectives ? "true" : "false",
                   o.overlap_step ? "true" : "false",
                   rank_medians.empty()
                       ? ""
                       : fmt::format("\"rank_ms_median\": [{:.4f}], ", fmt::join(rank_medians, ", ")),
                   extra)
            << std::endl;
}

int run_single(const Options& o) {
  const Device device(DeviceType::cuda, o.device);
  DeviceGuard on_device(device);
  Workload w = make(o.workload, device, o.batch);
  std::unique_ptr<train::Trainer> t = make_trainer(o, w.model, device);
  if (o.memory_trace) {
    // Memory held after each phase and the peak within it, and after each
    // backward node once backward begins.
    t->train_step().on_phase([&](StepPhase phase) {
      const MemoryStats m = memory_stats(device);
      std::cerr << fmt::format("{}: allocated {:.1f} MiB, peak in the phase {:.1f} MiB\n", step_phase_name(phase),
                               mib(m.allocated_bytes), mib(m.peak_allocated_bytes));
      reset_peak_memory_stats(device);
      set_backward_observer(phase != StepPhase::forward ? BackwardObserver() : [&](const std::string& name) {
        std::cerr << fmt::format("  after {}: {:.1f} MiB\n", name, mib(memory_stats(device).allocated_bytes));
      });
    });
  }
  reset_peak_memory_stats(device);
  const std::vector<double> times = time_steps(o, *t, {w.x, w.y});
  const MemoryStats mem = memory_stats(device);
  if (o.memory_trace)
    std::cerr << fmt::format("end: allocated {:.1f} MiB, peak allocated {:.1f} MiB, reserved {:.1f} MiB\n",
                             mib(mem.allocated_bytes), mib(mem.peak_allocated_bytes), mib(mem.reserved_bytes));
  const double med = median(times);
  std::string extra;
  if (w.sequence) {
    extra = fmt::format("\"attention_forward\": {}, \"attention_backward\": {}, ",
                        nlohmann::json(last_attention_kernel(false)).dump(),
                        nlohmann::json(last_attention_kernel(true)).dump());
    // Tokens per second, and the step's model FLOPs over the GEMM rate this
    // process gets from the GPU, measured here (after the timed steps, so
    // that they ran on a GPU no hotter than PyTorch's).
    extra += fmt::format("\"tokens_per_s\": {:.0f}, ", static_cast<double>(w.x.numel()) / med * 1e3);
    if (o.precision != "fp32") {
      // fp8 against the bf16 ceiling: how much faster than bf16's best the step runs.
      const double ceiling = bench::gemm_tflops(device, o.precision == "fp16" ? DType::f16 : DType::bf16);
      const double tflops = w.model_flops / med / 1e9;
      extra += fmt::format("\"model_tflops\": {:.1f}, \"gemm_ceiling_tflops\": {:.1f}, \"mfu\": {:.4f}, ", tflops,
                           ceiling, tflops / ceiling);
    }
  }
  print_result(o, "single", 1, w.x.shape()[0], med, times, t->last_loss(), mib(mem.peak_allocated_bytes),
               graphed(*t), {}, extra);
  return 0;
}

int run_dp(const Options& o) {
  const int n = cuda_device_count();
  std::vector<Device> devices;
  for (int i = 0; i < n; ++i) devices.emplace_back(DeviceType::cuda, i);
  // As torch_bench.py feeds nn.DataParallel: the whole batch on cuda:0;
  // the other replicas copy their shares to their GPUs for every step.
  Workload w = make(o.workload, devices[0], o.batch, n);
  dist::ReplicaGroup group(w.model, [&] { return make(o.workload, devices[0], 1).model; }, devices,
                           {.ddp = o.ddp, .peer_collectives = o.peer_collectives});
  const int64_t rows = w.x.shape()[0] / n;
  std::vector<std::vector<double>> times(n);
  std::vector<double> losses(n);
  std::vector<char> replica_graphed(n);
  for (const Device& d : devices) reset_peak_memory_stats(d);
  group.run([&](dist::Replica& r) {
    std::unique_ptr<train::Trainer> t = make_trainer(o, r.module, r.device, r.ddp.get());
    const auto begin = static_cast<int64_t>(r.rank) * rows;
    const data::Batch share{prim::slice(w.x, 0, begin, begin + rows), prim::slice(w.y, 0, begin, begin + rows)};
    times[r.rank] = time_steps(o, *t, share);
    losses[r.rank] = t->last_loss();
    replica_graphed[r.rank] = graphed(*t);
  });
  // The step is as slow as its slowest replica; the loss is the batch mean.
  size_t slowest = 0;
  for (int i = 1; i < n; ++i)
    if (median(times[i]) > median(times[slowest])) slowest = i;
  double loss = 0;
  for (double l : losses) loss += l / n;
  const bool all_graphed = std::all_of(replica_graphed.begin(), replica_graphed.end(), [](char g) { return g != 0; });
  // Registered bucket memory is not the caching allocator's: counted here.
  std::vector<double> replica_medians;
  for (const auto& t : times) replica_medians.push_back(median(t));
  print_result(o, "dp", n, w.x.shape()[0], median(times[slowest]), times[slowest], loss,
               mib(memory_stats(devices[0]).peak_allocated_bytes + group.replica(0).ddp->registered_bytes()),
               all_graphed, replica_medians);
  return 0;
}

int run_ddp(const Options& o) {
  dist::ProcessGroupOptions group_options;
  group_options.peer_collectives = o.peer_collectives;
  dist::Distributed world = dist::init_process_group("env://", group_options);
  const Device device(DeviceType::cuda, world.config.local_rank);
  DeviceGuard on_device(device);
  Workload w = make(o.workload, device, o.batch);
  dist::DistributedDataParallel ddp(w.model, world.group, o.ddp);
  std::unique_ptr<train::Trainer> t = make_trainer(o, w.model, device, &ddp);
  reset_peak_memory_stats(device);
  // Captured, the step's all-reduces are recorded into the graph with it.
  const std::vector<double> times = time_steps(o, *t, {w.x, w.y});
  // The job is as slow as its slowest rank.
  Tensor medians = zeros({world.config.world_size}, DType::f64, kCPU);
  prim::fill_(prim::slice(medians, 0, world.config.rank, world.config.rank + 1), median(times));
  world.group->allreduce(medians, dist::ReduceOp::sum)->wait();
  const std::vector<double> rank_medians = medians.to_vector<double>();
  if (world.config.rank == 0)
    print_result(o, "ddp", world.config.world_size, w.x.shape()[0] * world.config.world_size,
                 *std::max_element(rank_medians.begin(), rank_medians.end()), times, t->last_loss(),
                 mib(memory_stats(device).peak_allocated_bytes + ddp.registered_bytes()), graphed(*t), rank_medians);
  return 0;
}

// Without mpt-run's variables, --mode ddp starts this program again through
// mpt-run, one process per GPU (mpt-run prefixes their lines with the rank).
int relaunch_through_mpt_run(int argc, char** argv) {
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe");
  std::filesystem::path runner;
  for (const auto& candidate : {self.parent_path() / "mpt-run", self.parent_path().parent_path() / "mpt-run" / "mpt-run"})
    if (std::filesystem::exists(candidate)) runner = candidate;
  check<NotAvailableError>(!runner.empty(), "mpt-bench: --mode ddp needs mpt-run next to mpt-bench ({})",
                           self.parent_path().string());
  const std::string nproc = std::to_string(cuda_device_count());
  std::vector<std::string> args = {runner.string(), "--nproc_per_node", nproc, self.string()};
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  std::vector<char*> c_args;
  for (auto& a : args) c_args.push_back(a.data());
  c_args.push_back(nullptr);
  std::cout.flush();
  execv(c_args[0], c_args.data());
  throw Error(fmt::format("mpt-bench: could not start {}: {}", runner.string(), std::strerror(errno)));
}

}  // namespace

int main(int argc, char** argv) {
  using mpt::tools::non_negative;
  using mpt::tools::positive;
  Options o;
  CLI::App app{"mpt-bench: the reference workloads, timed as PyTorch's torch_bench.py (in ../shared/reference/, "
               "beside the checkout) times them"};
  app.option_defaults()->always_capture_default();
  app.add_option("--workload", o.workload,
                 "mlp_small, mlp_large, cnn, gpt_mini or gpt2_124m (the reference's), or cnn_bn (cnn with a "
                 "BatchNorm2d after each convolution)")
      ->check(CLI::IsMember({"mlp_small", "mlp_large", "cnn", "cnn_bn", "gpt_mini", "gpt2_124m"}));
  app.add_option("--mode", o.mode,
                 "single (one GPU), dp (a replica and a thread per GPU of this process), ddp (a process per GPU), "
                 "or allreduce (no workload: one all-reduce over every GPU, by size and way)")
      ->check(CLI::IsMember({"single", "dp", "ddp", "allreduce"}));
  app.add_option("--precision", o.precision,
                 "fp16 (autocast + loss scaler), bf16 (autocast), fp32, or fp8 (FP8 linear layers, delayed scaling, "
                 "bf16 elsewhere)")
      ->check(CLI::IsMember({"fp16", "bf16", "fp32", "fp8"}));
  app.add_option("--warmup", o.warmup, "untimed steps first")->check(non_negative());
  app.add_option("--steps", o.steps, "timed steps (the median is reported)")->check(positive());
  app.add_option("--batch", o.batch, "per-GPU batch (0: the workload's)")->check(non_negative());
  app.add_option("--device", o.device, "CUDA device index (single mode)")->check(non_negative());
  // Callbacks, not "!--no-graph": the help would show that as "--no-graph{false}".
  app.add_flag_callback("--no-graph", [&o] { o.graph = false; },
                        "run each step eagerly instead of replaying it as a CUDA graph");
  bool conv_autotune = false;
  app.add_flag("--conv-autotune", conv_autotune,
               "time cuDNN's convolution algorithms once per geometry instead of taking its heuristic picks");
  app.add_flag("--memory-trace", o.memory_trace,
               "single mode only: print allocated memory after forward and backward and after each backward node");
  app.add_flag("--timeline", o.timeline,
               "print the last step's timeline on each GPU (stamps of the GPU's timer at the step's phases, DDP's "
               "bucket fills and each collective's start and end; the stamps themselves cost a few us each)");
  double bucket_mb = 25, first_bucket_mb = 0;
  app.add_option("--bucket-mb", bucket_mb, "dp and ddp: gradient bucket size in MiB (PyTorch's bucket_cap_mb)")
      ->check(positive());
  app.add_option("--first-bucket-mb", first_bucket_mb,
                 "dp and ddp: size of the first bucket, which starts soonest (0: as --bucket-mb; PyTorch's is 1)")
      ->check(non_negative());
  std::string grad_transit = "f32";
  app.add_option("--grad-transit", grad_transit,
                 "dp, ddp and allreduce: dtype gradients are all-reduced in: f32 (the reference's), or f16 / bf16 "
                 "(half the traffic; PyTorch's fp16/bf16 compress hooks)")
      ->check(CLI::IsMember({"f32", "f16", "bf16"}));
  app.add_flag("--registered-buffers", o.ddp.registered_buffers,
               "dp and ddp: bucket buffers in NCCL symmetric windows (lower latency; a dead peer can then block a "
               "host that waits on the GPU)");
  app.add_flag("--peer-collectives", o.peer_collectives,
               "dp and ddp: bucket buffers that every GPU maps, all-reduced by mptrain's own kernel reading the "
               "other GPUs' memory directly (one host, peer access; implies --registered-buffers)");
  app.add_flag("--overlap-step", o.overlap_step,
               "dp and ddp: overlap the last gradient bucket's all-reduce with the optimizer step of the other "
               "parameters (DistributedDataParallel::overlap_step_with)");
  app.add_flag_callback("--weights-cast-per-op", [&o] { o.cast_weights_ahead = false; },
                        "let each op cast its weights under autocast instead of casting them all in one launch before "
                        "forward");
  app.add_flag("--fp8-copies-in-optimizer", o.fp8_copies_in_optimizer,
               "fp8: AdamW's step writes the weights' FP8 copies as it updates them, instead of a pass of their own "
               "at the next forward (the same bits)");
  app.add_flag_callback("--fp8-unfused-mlp", [&o] { o.fp8_fused_mlp = false; },
                        "fp8: GPT's MLP as its three ops instead of one fp8_mlp with GELU folded into the FP8 "
                        "quantizations (the same bits)");
  mpt::bench::AllreduceSweepOptions sweep;
  app.add_option("--ways", sweep.ways,
                 "allreduce: nccl (ordinary memory), symmetric (an NCCL symmetric window), peer (mptrain's own "
                 "kernel on memory every GPU maps)")
      ->check(CLI::IsMember({"nccl", "symmetric", "peer"}));
  app.add_option("--sizes-kib", sweep.sizes_kib, "allreduce: the sizes timed, in KiB")->check(positive());
  app.add_option("--per-replay", sweep.per_replay, "allreduce: all-reduces recorded into one CUDA graph")
      ->check(positive());
  bool cudnn_attention = true;
  app.add_option("--cudnn-attention", cudnn_attention,
                 "fused attention through cuDNN where it takes the shape (off: the own kernels run it all)");
  bool weight_grads_in_order = false;
  app.add_flag("--weight-grads-in-order", weight_grads_in_order,
               "compute weight gradients on backward's own stream, in order, instead of beside the chain of input "
               "gradients on a second stream");
  if (const auto status = mpt::tools::parse_command_line(app, argc, argv)) return *status;
  if (o.memory_trace && o.mode != "single") {
    std::cerr << "mpt-bench: --memory-trace works in single mode only, not with --mode " << o.mode << "\n";
    return mpt::tools::kUsageError;
  }
  beside::set_enabled(!weight_grads_in_order);
  if (grad_transit != "f32") o.ddp.compression = dtype_from_name(grad_transit);
  if (o.peer_collectives) o.ddp.registered_buffers = true;
  // Every collective of a timed step is replayed inside its graph, and the
  // few outside one (set-up, the final median) run only when no graph is in
  // flight, so NCCL need not order graphed against ungraphed operations of
  // a communicator, an ordering that costs time in every step. A value in
  // the environment wins. (Set before mpt-run starts the ranks.)
  setenv("NCCL_GRAPH_MIXING_SUPPORT", "0", /*overwrite=*/0);
  o.ddp.bucket_bytes = static_cast<size_t>(bucket_mb * 1048576.0);
  o.ddp.first_bucket_bytes = static_cast<size_t>(first_bucket_mb * 1048576.0);
  try {
    if (cuda_device_count() == 0) {
      std::cerr << "mpt-bench: skipped: no CUDA device\n";
      return 77;  // the "skipped" status of automake and ctest, apart from a usage error's 2
    }
    // As the reference does: f32 matmuls and convolutions may use TF32.
    set_allow_tf32(true);
    set_conv_autotune(conv_autotune);
    set_cudnn_attention(cudnn_attention);
    if (o.mode == "allreduce") {
      sweep.dtype = o.ddp.compression.value_or(DType::f32);
      sweep.warmup = o.warmup;
      sweep.replays = o.steps;
      return mpt::bench::run_allreduce_sweep(sweep);
    }
    if (o.mode == "dp") return run_dp(o);
    if (o.mode == "ddp") return std::getenv("WORLD_SIZE") ? run_ddp(o) : relaunch_through_mpt_run(argc, argv);
    return run_single(o);
  } catch (const std::exception& e) {
    // mpt::Error, or what the standard library throws (std::filesystem, std::bad_alloc).
    const std::string message = e.what();
    std::cerr << (message.starts_with("mpt-bench:") ? "" : "mpt-bench: ") << message << "\n";
    return 1;
  }
}
