// One rank of the DDP tests, started by mpt-run. Modes:
//   plain     DDP steps with the loss scaler (GradScaler; rank 1 overflows
//             on one step, so every rank must skip it) equal one process
//             training on the concatenated batch (checked here, relative 1e-6)
//   accum     the same with k-step no_sync() accumulation windows
//   compress  bf16 gradients in transit (looser tolerance, and a least
//             error: the averaged gradients must be bf16 values, and the
//             parameters must drift from the f32 reference by more than
//             f32 transit's rounding would take them)
//   unused    a parameter without gradient: an error naming it, or (with
//             find_unused_parameters) a normal step that leaves it alone
//   die       rank 1 exits with status 7 after rendezvous while rank 0
//             is busy for a minute (mpt-run must stop it)
//   sleep     both ranks busy for a minute (for stopping mpt-run itself)
//   train     DDP steps for about a minute, printing "rank R: step S" every
//             10 steps: a run to hurt from outside (kill a rank, cut the
//             link); a collective that fails ends it with status 3 and the
//             error, which names the rank that went away
//   train_graphed  the same with each step replayed as a CUDA graph (GPU)
//   peer_ipc, peer_ipc_killed  PeerAllReduce between two processes on
//             cuda:0, over CUDA IPC (see parallel/peer_ipc_modes.h)
// MPT_TEST_TIMEOUT_S sets the collectives' timeout (default 30 s);
// MPT_TEST_PEER_COLLECTIVES=1 keeps DDP's buckets in registered memory
// all-reduced by the group's own kernel (ProcessGroupOptions::peer_collectives).
// A second argument "cuda" runs plain/accum/compress/train(_graphed) on GPU LOCAL_RANK
// over NCCL. Exit status 0 means every check passed; messages say what failed.
#include <unistd.h>

#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <fmt/format.h>

#include "amp/grad_scaler.h"
#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "models/sgd.h"
#include "parallel/distributed_data_parallel.h"
#include "parallel/device_routed_group.h"
#include "parallel/counting_group.h"
#include "parallel/tiny_models.h"
#include "tensor/graph.h"
#include "tensor/ops.h"

#ifdef MPT_WITH_CUDA
#include "parallel/peer_ipc_modes.h"
#endif

using namespace mpt;
using namespace mpt::dist;

namespace {

constexpr int kRowsPerRank = 4;

bool peer_collectives() {
  const char* v = std::getenv("MPT_TEST_PEER_COLLECTIVES");
  return v != nullptr && std::string(v) == "1";
}

// A scaler that grows every 2 clean steps, so the scale moves during the run.
amp::GradScalerOptions scaler_options() {
  amp::GradScalerOptions o;
  o.init_scale = 1024.0;
  o.growth_interval = 2;
  return o;
}

// An overflow: one gradient becomes inf.
void overflow(nn::Module& m) {
  NoGradGuard no_grad;
  prim::fill_(m.parameters().front().grad(), INFINITY);
}

// Whether every gradient of m holds values of `transit`, as an all-reduce
// in that dtype hands them back: from an f32 all-reduce almost every element
// would lie between two of them.
bool gradients_are_values_of(nn::Module& m, DType transit) {
  for (auto& p : m.parameters())
    for (float v : p.grad().to_vector<float>()) {
      const float rounded = transit == DType::bf16 ? float(BFloat16(v)) : float(Half(v));
      if (rounded != v) return false;
    }
  return true;
}

double max_rel_error(nn::Module& a, nn::Module& b) {
  double worst = 0;
  auto pa = a.parameters(), pb = b.parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    auto x = pa[i].to_vector<double>(), y = pb[i].to_vector<double>();
    double num = 0, den = 0;
    for (size_t k = 0; k < x.size(); ++k) {
      num += (x[k] - y[k]) * (x[k] - y[k]);
      den += y[k] * y[k];
    }
    worst = std::max(worst, std::sqrt(num / std::max(den, 1e-30)));
  }
  return worst;
}

// `least_error`: the error the run must exceed (0: none), where rounding in
// transit must show.
int train_and_compare(ProcessGroup& pg, int window, std::optional<DType> compression, double tolerance,
                      double least_error, const Device& device) {
  const int rank = pg.rank(), world = pg.size(), steps = 4, skip_step = 2;
  const int rows_per_step = window * world * kRowsPerRank;
  Generator data_gen(1234);
  const Tensor X = randn({steps * rows_per_step, 6}, DType::f32, kCPU, &data_gen);
  const Tensor Y = randn({steps * rows_per_step, 3}, DType::f32, kCPU, &data_gen);

  auto model = testing::make_mlp(7);
  if (rank != 0) {  // the broadcast at construction must undo this
    NoGradGuard no_grad;
    for (auto& p : model->parameters()) prim::fill_(p, 0.5);
  }
  model->to(device);
  DdpOptions options;
  options.first_bucket_bytes = 256;  // several buckets even for this small model
  options.bucket_bytes = 1024;
  options.compression = compression;
  options.registered_buffers = peer_collectives();
  auto counting = std::make_shared<testing::CountingGroup>(pg);
  DistributedDataParallel ddp(model, counting, options);
  optim::SGD opt(model->parameters(), {.lr = 0.05, .momentum = 0.9});
  amp::GradScaler scaler(scaler_options());
  scaler.set_found_inf_reducer([&ddp](Tensor& found_inf) { ddp.allreduce_found_inf(found_inf); });

  auto reference = testing::make_mlp(7);
  reference->to(device);
  optim::SGD ref_opt(reference->parameters(), {.lr = 0.05, .momentum = 0.9});
  amp::GradScaler ref_scaler(scaler_options());

  for (int s = 0; s < steps; ++s) {
    for (int j = 0; j < window; ++j) {
      const int64_t first = s * rows_per_step + (j * world + rank) * kRowsPerRank;
      const Tensor x = prim::to(prim::slice(X, 0, first, first + kRowsPerRank), device);
      const Tensor y = prim::to(prim::slice(Y, 0, first, first + kRowsPerRank), device);
      auto step = [&] { backward(scaler.scale(mul(mse_loss(ddp(x), y), 1.0 / window))); };
      if (j + 1 < window) {
        auto guard = ddp.no_sync();
        const int before = counting->allreduces;
        step();
        if (counting->allreduces != before) {
          fmt::print(stderr, "rank {}: a backward inside no_sync() communicated\n", rank);
          return 1;
        }
      } else {
        step();
      }
    }
    if (compression && !gradients_are_values_of(*model, *compression)) {
      fmt::print(stderr, "rank {}: step {}: the averaged gradients are not {} values: compression was not applied\n",
                 rank, s, dtype_name(*compression));
      return 1;
    }
    // Rank 1 overflows on one step: the scaler's found_inf, agreed over the
    // ranks, makes every rank skip it.
    if (s == skip_step && rank == 1) overflow(*model);
    scaler.step(opt);
    scaler.update();
    opt.zero_grad();

    const Tensor xs = prim::to(prim::slice(X, 0, s * rows_per_step, (s + 1) * rows_per_step), device);
    const Tensor ys = prim::to(prim::slice(Y, 0, s * rows_per_step, (s + 1) * rows_per_step), device);
    backward(ref_scaler.scale(mse_loss(reference->forward(xs), ys)));
    if (s == skip_step) overflow(*reference);
    ref_scaler.step(ref_opt);
    ref_scaler.update();
    ref_opt.zero_grad();
  }
  if (scaler.get_scale() != ref_scaler.get_scale()) {
    fmt::print(stderr, "rank {}: loss scale {} differs from the single process's {}\n", rank, scaler.get_scale(),
               ref_scaler.get_scale());
    return 1;
  }
  const double err = max_rel_error(*model, *reference);
  fmt::print("rank {}: {} buckets (rebuilt: {}), max relative parameter error {:.3g} (tolerance {:.1g}, least "
             "{:.1g})\n",
             rank, ddp.bucket_assignment().size(), ddp.buckets_rebuilt(), err, tolerance, least_error);
  const bool rounding_shows = least_error == 0 || err > least_error;
  if (!(err <= tolerance) || !rounding_shows || !ddp.buckets_rebuilt() || ddp.bucket_assignment().size() < 2) {
    fmt::print(stderr, "rank {}: FAILED\n", rank);
    return 1;
  }
  return 0;
}

int unused_parameters(ProcessGroup& pg) {
  auto shared = std::shared_ptr<ProcessGroup>(&pg, [](ProcessGroup*) {});
  const Tensor x = randn({4, 6}), y = randn({4, 3});
  {  // without detection: the next forward names the parameters
    auto model = std::make_shared<testing::WithSpareHead>(3);
    DistributedDataParallel ddp(model, shared);
    backward(mse_loss(ddp(x), y));
    try {
      ddp(x);
      fmt::print(stderr, "rank {}: expected an error about unused parameters\n", pg.rank());
      return 1;
    } catch (const ValueError& e) {
      const std::string msg = e.what();
      if (msg.find("spare.weight") == std::string::npos || msg.find("find_unused_parameters") == std::string::npos) {
        fmt::print(stderr, "rank {}: unhelpful message: {}\n", pg.rank(), msg);
        return 1;
      }
      fmt::print("rank {}: unused parameters reported: {}\n", pg.rank(), msg.substr(0, 120));
    }
  }
  {  // with detection: a normal step; the spare head keeps no gradient
    auto model = std::make_shared<testing::WithSpareHead>(3);
    DistributedDataParallel ddp(model, shared, {.find_unused_parameters = true});
    for (int i = 0; i < 2; ++i) {
      model->zero_grad();
      backward(mse_loss(ddp(x), y));
    }
    if (model->spare->weight.grad().defined() || !model->used->weight.grad().defined()) {
      fmt::print(stderr, "rank {}: find_unused_parameters gave the wrong gradients\n", pg.rank());
      return 1;
    }
    fmt::print("rank {}: find_unused_parameters ok\n", pg.rank());
  }
  return 0;
}

// A long run with nothing to compare: it ends when the time is up or a
// collective fails (the error leaves through main's handler).
// `graphed`: each step replayed as a CUDA graph (CapturedStep), its
// all-reduces inside.
int train_until_stopped(ProcessGroup& pg, const std::shared_ptr<ProcessGroup>& shared, const Device& device,
                        bool graphed) {
  auto model = testing::make_mlp(7);
  model->to(device);
  DistributedDataParallel ddp(model, shared, {.registered_buffers = peer_collectives()});
  optim::SGD opt(model->parameters(), {.lr = 0.01});
  auto step_on = [&](const std::vector<Tensor>& in) {
    backward(mse_loss(ddp(in[0]), in[1]));
    opt.step();
    opt.zero_grad();
  };
  CapturedStep captured(device, step_on);
  Generator gen(100 + pg.rank());
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (int step = 0; std::chrono::steady_clock::now() < until; ++step) {
    const Tensor x = prim::to(randn({kRowsPerRank, 6}, DType::f32, kCPU, &gen), device);
    const Tensor y = prim::to(randn({kRowsPerRank, 3}, DType::f32, kCPU, &gen), device);
    if (graphed) captured.run({x, y});
    else step_on({x, y});
    if (graphed && step == 5 && !captured.captured()) {
      fmt::print(stderr, "rank {}: the step was not captured: {}\n", pg.rank(), captured.fallback_reason());
      return 4;
    }
    if (step % 10 == 0) {
      fmt::print("rank {}: step {}\n", pg.rank(), step);
      std::fflush(stdout);
    }
    ::usleep(5000);  // leave the CPU to the other ranks of this small machine
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "plain";
  const bool on_gpu = argc > 2 && std::string(argv[2]) == "cuda";
  try {
    ProcessGroupOptions pg_options;
    pg_options.timeout = std::chrono::seconds(30);
    if (const char* t = std::getenv("MPT_TEST_TIMEOUT_S")) pg_options.timeout = std::chrono::seconds(std::atoi(t));
#ifdef MPT_WITH_CUDA
    if (mode.rfind("peer_ipc", 0) == 0) return testing::peer_ipc_mode(mode, pg_options.timeout);
#endif
    pg_options.peer_collectives = peer_collectives();
    auto dist = init_process_group("env://", pg_options);
    // One GPU per local rank (NCCL), or the CPU (Gloo): the group routes by
    // the tensors' device.
    const Device device = on_gpu ? Device(DeviceType::cuda, dist.config.local_rank) : kCPU;
    auto pg = dist.group;
    fmt::print("rank {} of {} ready, pid {}{}\n", pg->rank(), pg->size(), ::getpid(),
               pg_options.peer_collectives ? ", peer collectives" : "");
    std::fflush(stdout);
    // GPU GEMMs may sum in another order for another batch size.
    const double tolerance = on_gpu ? 1e-5 : 1e-6;
    if (mode == "plain") return train_and_compare(*pg, 1, std::nullopt, tolerance, 0.0, device);
    if (mode == "accum") return train_and_compare(*pg, 3, std::nullopt, tolerance, 0.0, device);
    // bf16 rounds each averaged gradient by up to 2^-9 of it; over the
    // three steps taken that moves this model's parameters by about 1e-4 to
    // 1e-3 of their norm (for other seeds of model and data too, hardly ever
    // below 1e-4). f32 transit stays within `tolerance` (1e-6 on the CPU,
    // 1e-5 on a GPU, as plain checks; about 1e-7 in practice). The check of
    // the gradients' values in train_and_compare is the sharp one.
    if (mode == "compress") return train_and_compare(*pg, 2, DType::bf16, 2e-2, 1e-5, device);
    if (mode == "unused") return unused_parameters(*pg);
    if (mode == "die") {
      pg->barrier()->wait();  // both ranks are up and connected
      if (pg->rank() == 1) {
        fmt::print(stderr, "rank 1 exits on purpose\n");
        std::fflush(stderr);
        ::_exit(7);
      }
      ::sleep(60);  // a long step: mpt-run must stop this rank, not wait for it
      return 0;
    }
    if (mode == "train") return train_until_stopped(*pg, pg, device, false);
    if (mode == "train_graphed") return train_until_stopped(*pg, pg, device, true);
    if (mode == "sleep") {  // both ranks busy until stopped from outside
      pg->barrier()->wait();
      ::sleep(60);
      return 0;
    }
    fmt::print(stderr, "unknown mode '{}'\n", mode);
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 3;
  }
}
