// The CPU's fused attention against the composed math autograd runs without
// it (the same autograd op with the fused kernels switched off:
// set_cpu_fused_kernels, tensor/backend_settings.h), and GELU forward and
// backward (tensor/cpu/fast_math.h's erf and exp, split over the threads),
// on gpt_mini's shapes: heads of 64 over 256 positions, 6 heads, a quarter
// of its batch of 64 (16 sequences); its MLP activations, 16384 x 1536.
//
//   build-cpu/bench/bench_cpu_attention --benchmark_filter=attention
//
// Names: attention/<B>x<H>x<T>x<D>/<dtype>/<forward|forward_backward>/<fused|composed>;
// gelu/<rows>x<cols>/<dtype>/<forward|forward_backward>.
#include <benchmark/benchmark.h>

#include <string>

#include "autograd/ops.h"
#include "tensor/backend_settings.h"

namespace mpt {
namespace {

void attention_bench(benchmark::State& state, DType dtype, bool with_backward, bool fused) {
  const int64_t B = 16, H = 6, T = 256, D = 64;
  Generator gen(1);
  Tensor q = randn({B, H, T, D}, dtype, kCPU, &gen), k = randn({B, H, T, D}, dtype, kCPU, &gen),
         v = randn({B, H, T, D}, dtype, kCPU, &gen);
  const Tensor dy = randn({B, H, T, D}, dtype, kCPU, &gen);
  if (with_backward)
    for (Tensor* t : {&q, &k, &v}) t->set_requires_grad(true);
  set_cpu_fused_kernels(fused);
  for (auto _ : state) {
    const Tensor y = scaled_dot_product_attention(q, k, v, true);
    if (with_backward) {
      backward(y, dy);
      for (Tensor* t : {&q, &k, &v}) t->set_grad(Tensor());
    }
    benchmark::DoNotOptimize(y);
  }
  set_cpu_fused_kernels(true);
  // Multiply-adds of the causal products the math asks for (half of the
  // square): 2 forward, 5 with backward (the probabilities recomputed).
  const double products = (with_backward ? 5.0 : 2.0) * static_cast<double>(B * H * T * T * D) / 2;
  state.counters["GFLOP/s"] =
      benchmark::Counter(2 * products * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

void gelu_bench(benchmark::State& state, DType dtype, bool with_backward) {
  const int64_t rows = 16384, cols = 1536;
  Generator gen(1);
  Tensor x = randn({rows, cols}, dtype, kCPU, &gen);
  const Tensor dy = randn({rows, cols}, dtype, kCPU, &gen);
  if (with_backward) x.set_requires_grad(true);
  for (auto _ : state) {
    const Tensor y = gelu(x);
    if (with_backward) {
      backward(y, dy);
      x.set_grad(Tensor());
    }
    benchmark::DoNotOptimize(y);
  }
  state.SetItemsProcessed(rows * cols * state.iterations());
}

const bool registered = [] {
  for (DType dt : {DType::f32, DType::bf16})
    for (bool with_backward : {false, true}) {
      const std::string pass = with_backward ? "/forward_backward" : "/forward";
      for (bool fused : {true, false})
        benchmark::RegisterBenchmark(
            (std::string("attention/16x6x256x64/") + dtype_name(dt) + pass + (fused ? "/fused" : "/composed")).c_str(),
            [=](benchmark::State& s) { attention_bench(s, dt, with_backward, fused); })
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      benchmark::RegisterBenchmark((std::string("gelu/16384x1536/") + dtype_name(dt) + pass).c_str(),
                                   [=](benchmark::State& s) { gelu_bench(s, dt, with_backward); })
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  return true;
}();

}  // namespace
}  // namespace mpt

BENCHMARK_MAIN();
