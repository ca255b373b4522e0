// The host's cost of running ops eagerly: checks, dispatch, autograd
// records, allocation. Tensors are tiny and on the CPU, so the arithmetic
// is nearly free and what is timed is what every eager op pays before its
// kernel, on the GPU too (where a step of small layers waits on the host).
//
//   build/bench_host_overhead                       all of them
//   build/bench_host_overhead --benchmark_filter=Step
//
// Compare builds on one machine in one sitting; for counts that do not
// depend on the machine's load, run a filter under
// `valgrind --tool=callgrind`.
#include <benchmark/benchmark.h>

#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "models/adamw.h"
#include "models/mlp.h"
#include "tensor/ops.h"
#include "train/trainer.h"

namespace mpt {
namespace {

void add_without_history(benchmark::State& state) {
  Generator gen(1);
  const Tensor a = randn({4, 4}, DType::f32, kCPU, &gen);
  const Tensor b = randn({4, 4}, DType::f32, kCPU, &gen);
  for (auto _ : state) benchmark::DoNotOptimize(add(a, b));
}
BENCHMARK(add_without_history);

// The same op recorded for backward: a node, its saved operands, and the
// output's autograd slot.
void add_recorded(benchmark::State& state) {
  Generator gen(1);
  Tensor a = randn({4, 4}, DType::f32, kCPU, &gen);
  const Tensor b = randn({4, 4}, DType::f32, kCPU, &gen);
  a.set_requires_grad(true);
  for (auto _ : state) benchmark::DoNotOptimize(add(a, b));
}
BENCHMARK(add_recorded);

void linear_forward_and_backward(benchmark::State& state) {
  Generator gen(1);
  const Tensor x = randn({4, 16}, DType::f32, kCPU, &gen);
  Tensor w = randn({16, 16}, DType::f32, kCPU, &gen);
  Tensor bias = randn({16}, DType::f32, kCPU, &gen);
  w.set_requires_grad(true);
  bias.set_requires_grad(true);
  for (auto _ : state) {
    backward(sum(relu(linear(x, w, bias))));
    w.set_grad(Tensor());
    bias.set_grad(Tensor());
  }
}
BENCHMARK(linear_forward_and_backward);

// A whole training step of a three-layer MLP (16-64-64-4, a batch of 8),
// as train::Trainer runs it: forward, cross-entropy, backward, AdamW, and
// the step's loss and right predictions counted. With f16 autocast, the
// loss scaler scales, unscales, checks for inf and updates as well.
void mlp_training_step(benchmark::State& state, bool f16_autocast) {
  Generator gen(1);
  auto mlp = nn::make_mlp({.in_features = 16, .hidden = {64, 64}, .num_classes = 4}, &gen);
  train::TrainerOptions options;
  options.step.precision = f16_autocast ? train::Precision::fp16 : train::Precision::fp32;
  options.time_steps = false;
  train::Trainer trainer(mlp, std::make_unique<optim::AdamW>(mlp->parameters()), train::classification(), options);
  const data::Batch batch{randn({8, 16}, DType::f32, kCPU, &gen),
                          from_vector<int64_t>({0, 1, 2, 3, 0, 1, 2, 3}, {8}, DType::i64)};
  for (auto _ : state) trainer.step({batch});
}
BENCHMARK_CAPTURE(mlp_training_step, f32, false);
BENCHMARK_CAPTURE(mlp_training_step, f16_autocast_and_scaler, true);

}  // namespace
}  // namespace mpt

BENCHMARK_MAIN();
