// The CPU's fused layer norm and softmax cross-entropy against the composed
// math autograd runs without them (the same autograd ops, with the fused
// kernels switched off: set_cpu_fused_kernels, tensor/backend_settings.h),
// on gpt_mini's shapes: its norms (64 x 256 tokens of 384), its loss over a
// character vocabulary (65) and over GPT-2's (50304; 1024 rows, a quarter
// of a 4096-token batch: the composed path's temporaries of that size take
// gigabytes).
//
//   build-cpu/bench/bench_cpu_norm_ce --benchmark_filter=layer_norm
//
// Names: <op>/<shape>/<dtype>/<forward|forward_backward>/<fused|composed>;
// layer_norm's "f32_to_bf16" is autocast's case, f32 rows written in bf16.
#include <benchmark/benchmark.h>

#include <functional>
#include <random>
#include <string>
#include <vector>

#include "autograd/ops.h"
#include "tensor/backend_settings.h"

namespace mpt {
namespace {

// Runs `step` under the kernels' setting, restoring the default after.
template <typename F>
void timed(benchmark::State& state, bool fused, F&& step) {
  set_cpu_fused_kernels(fused);
  for (auto _ : state) step();
  set_cpu_fused_kernels(true);
}

void layer_norm_bench(benchmark::State& state, int64_t rows, int64_t d, DType y_dtype, bool with_backward,
                      bool fused) {
  Generator gen(1);
  Tensor x = randn({rows, d}, DType::f32, kCPU, &gen), w = randn({d}, DType::f32, kCPU, &gen),
         b = randn({d}, DType::f32, kCPU, &gen);
  const Tensor dy = randn({rows, d}, y_dtype, kCPU, &gen);
  if (with_backward)
    for (Tensor* t : {&x, &w, &b}) t->set_requires_grad(true);
  timed(state, fused, [&] {
    const Tensor y = layer_norm(x, w, b, 1e-5, y_dtype);
    if (with_backward) {
      backward(y, dy);
      for (Tensor* t : {&x, &w, &b}) t->set_grad(Tensor());
    }
    benchmark::DoNotOptimize(y);
  });
  // Bytes of x read and y written (and dy read, dx written, backward).
  const double bytes = static_cast<double>(rows * d) *
                       (with_backward ? 2.0 * 4 + 2.0 * static_cast<double>(dtype_size(y_dtype))
                                      : 4 + static_cast<double>(dtype_size(y_dtype)));
  state.SetBytesProcessed(static_cast<int64_t>(bytes) * state.iterations());
}

void cross_entropy_bench(benchmark::State& state, int64_t rows, int64_t classes, DType dtype, bool with_backward,
                         bool fused) {
  Generator gen(1);
  Tensor logits = randn({rows, classes}, dtype, kCPU, &gen);
  std::mt19937_64 rng(1);
  std::vector<int64_t> t(static_cast<size_t>(rows));
  for (int64_t& v : t) v = static_cast<int64_t>(rng() % static_cast<uint64_t>(classes));
  const Tensor target = from_vector(t, {rows}, DType::i64);
  if (with_backward) logits.set_requires_grad(true);
  timed(state, fused, [&] {
    const Tensor loss = cross_entropy(logits, target);
    if (with_backward) {
      backward(loss);
      logits.set_grad(Tensor());
    }
    benchmark::DoNotOptimize(loss);
  });
  state.SetItemsProcessed(rows * classes * state.iterations());
}

void add(const std::string& name, const std::function<void(benchmark::State&, bool, bool)>& f) {
  for (bool with_backward : {false, true})
    for (bool fused : {true, false}) {
      const std::string full =
          name + (with_backward ? "/forward_backward" : "/forward") + (fused ? "/fused" : "/composed");
      benchmark::RegisterBenchmark(full.c_str(), [=](benchmark::State& s) { f(s, with_backward, fused); })
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
}

const bool registered = [] {
  for (DType y : {DType::f32, DType::bf16})
    add(std::string("layer_norm/16384x384/") + (y == DType::f32 ? "f32" : "f32_to_bf16"),
        [y](benchmark::State& s, bool bwd, bool fused) { layer_norm_bench(s, 16384, 384, y, bwd, fused); });
  for (DType dt : {DType::f32, DType::bf16}) {
    add(std::string("cross_entropy/16384x65/") + dtype_name(dt),
        [dt](benchmark::State& s, bool bwd, bool fused) { cross_entropy_bench(s, 16384, 65, dt, bwd, fused); });
    add(std::string("cross_entropy/1024x50304/") + dtype_name(dt),
        [dt](benchmark::State& s, bool bwd, bool fused) { cross_entropy_bench(s, 1024, 50304, dt, bwd, fused); });
  }
  return true;
}();

}  // namespace
}  // namespace mpt

BENCHMARK_MAIN();
