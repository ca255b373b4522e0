// mpt-bench: the reference workloads of shared/reference/torch_bench.py
// (same shapes, batch sizes, optimizer, precision and step), timed with
// CUDA events: warm-up steps, then the median of the timed ones. Prints one
// JSON line per run in torch_bench.py's form, plus peak GPU memory.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "autograd/engine.h"
#include "autograd/ops.h"
#include "models/adamw.h"
#include "models/cnn.h"
#include "models/gpt.h"
#include "models/mlp.h"
#include "tensor/cuda/gemm.h"
#include "tensor/memory.h"
#include "tensor/ops.h"
#include "tensor/stream.h"

namespace {

using namespace mpt;

struct Workload {
  std::shared_ptr<nn::Module> model;
  Tensor x, y;
  bool sequence = false;  // logits [B, T, V]: flatten for the loss
};

Tensor random_labels(int64_t n, int64_t classes, const Shape& shape, std::mt19937_64& rng, const Device& d) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t& t : v) t = static_cast<int64_t>(rng() % static_cast<uint64_t>(classes));
  return prim::to(from_vector(v, shape, DType::i64), d);
}

Workload make(const std::string& name, const Device& device, int64_t batch) {
  Generator gen(0);
  std::mt19937_64 rng(0);
  Workload w;
  if (name == "mlp_small") {
    const int64_t b = batch ? batch : 256;
    w.model = nn::make_mlp({}, &gen);
    w.x = randn({b, 784}, DType::f32, kCPU, &gen);
    w.y = random_labels(b, 10, {b}, rng, device);
  } else if (name == "mlp_large") {
    const int64_t b = batch ? batch : 8192;
    w.model = nn::make_mlp({8192, {8192, 8192, 8192}, 10}, &gen);
    w.x = randn({b, 8192}, DType::f32, kCPU, &gen);
    w.y = random_labels(b, 10, {b}, rng, device);
  } else if (name == "cnn") {
    const int64_t b = batch ? batch : 512;
    w.model = nn::make_cnn({}, &gen);
    w.x = randn({b, 1, 28, 28}, DType::f32, kCPU, &gen);
    w.y = random_labels(b, 10, {b}, rng, device);
  } else if (name == "gpt_mini") {
    const int64_t b = batch ? batch : 64;
    w.model = std::make_shared<nn::GPT>(nn::GPTOptions{}, &gen);
    w.x = random_labels(b * 256, 65, {b, 256}, rng, kCPU);
    w.y = random_labels(b * 256, 65, {b, 256}, rng, device);
    w.sequence = true;
  } else {
    throw ValueError("mpt-bench: unknown workload '" + name + "' (mlp_small, mlp_large, cnn, gpt_mini)");
  }
  w.model->to(device);
  w.x = prim::to(w.x, device);
  return w;
}

Tensor loss_of(const Workload& w, const Tensor& out) {
  if (w.sequence) return cross_entropy(reshape(out, {-1, out.shape().back()}), reshape(w.y, {-1}));
  return cross_entropy(out, w.y);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Options {
  std::string workload = "mlp_small";
  std::string mode = "single";
  std::string precision = "fp16";
  int warmup = 20;
  int steps = 100;
  int64_t batch = 0;
  int device = 0;
};

int run_single(const Options& o) {
  const Device device(DeviceType::cuda, o.device);
  // As the reference does: f32 matmuls and convolutions may use TF32.
  cuda::set_allow_tf32(true);
  Workload w = make(o.workload, device, o.batch);
  optim::AdamW opt(w.model->parameters(), optim::AdamWOptions{1e-4, 0.9, 0.999, 1e-8, 1e-2});
  amp::GradScalerOptions so;
  so.enabled = o.precision == "fp16";
  amp::GradScaler scaler(so);
  const bool autocast = o.precision != "fp32";
  const DType amp_dtype = o.precision == "bf16" ? DType::bf16 : DType::f16;

  reset_peak_memory_stats(device);
  std::vector<double> times;
  Tensor loss;
  for (int i = 0; i < o.warmup + o.steps; ++i) {
    Event start(device, true), end(device, true);
    start.record();
    {
      amp::AutocastGuard guard(DeviceType::cuda, amp_dtype, autocast);
      loss = loss_of(w, w.model->forward(w.x));
    }
    opt.zero_grad();
    backward(scaler.scale(loss));
    scaler.step(opt);
    scaler.update();
    end.record();
    end.synchronize();
    if (i >= o.warmup) times.push_back(start.elapsed_ms(end));
  }
  const double med = median(times);
  const int64_t batch = w.x.shape()[0];
  const MemoryStats mem = memory_stats(device);
  // Written by hand so the figures keep their rounding (a JSON library
  // prints a double's full expansion).
  std::cout << fmt::format(
                   "{{\"workload\": \"{}\", \"mode\": \"single\", \"gpus\": 1, \"precision\": \"{}\", "
                   "\"batch\": {}, \"step_ms_median\": {:.4f}, \"step_ms_min\": {:.4f}, \"step_ms_max\": {:.4f}, "
                   "\"samples_per_s\": {:.1f}, \"loss\": {}, \"peak_mem_mb\": {:.1f}, \"impl\": \"mptrain\"}}",
                   o.workload, o.precision, batch, med, *std::min_element(times.begin(), times.end()),
                   *std::max_element(times.begin(), times.end()), batch / med * 1e3, loss.item(),
                   mem.peak_allocated_bytes / 1048576.0)
            << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"mpt-bench: the reference workloads, timed as shared/reference/torch_bench.py times them"};
  app.add_option("--workload", o.workload, "mlp_small, mlp_large, cnn or gpt_mini")
      ->check(CLI::IsMember({"mlp_small", "mlp_large", "cnn", "gpt_mini"}));
  app.add_option("--mode", o.mode, "single (one GPU)")->check(CLI::IsMember({"single"}));
  app.add_option("--precision", o.precision, "fp16 (autocast + loss scaler), bf16 (autocast) or fp32")
      ->check(CLI::IsMember({"fp16", "bf16", "fp32"}));
  app.add_option("--warmup", o.warmup, "untimed steps first")->check(CLI::NonNegativeNumber);
  app.add_option("--steps", o.steps, "timed steps (the median is reported)")->check(CLI::PositiveNumber);
  app.add_option("--batch", o.batch, "per-GPU batch (default: the workload's)")->check(CLI::NonNegativeNumber);
  app.add_option("--device", o.device, "CUDA device index")->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    if (cuda_device_count() == 0) {
      std::cerr << "mpt-bench: skipped: no CUDA device\n";
      return 2;
    }
    return run_single(o);
  } catch (const Error& e) {
    std::cerr << "mpt-bench: " << e.what() << "\n";
    return 1;
  }
}
