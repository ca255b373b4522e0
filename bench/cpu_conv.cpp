// The CPU's convolutions, max pooling and casts on the cnn's shapes (batch
// 128 of Fashion-MNIST: 1 -> 32 channels at 28x28, 32 -> 64 at 14x14, 2x2
// pooling after each), in f32 and bf16; bf16 convolutions with their
// products on oneDNN's bf16 kernels where this CPU has them and oneDNN
// takes them ("onednn": the first layer's small products stay with Eigen)
// and on Eigen in f32 ("eigen", set_cpu_onednn(kNever)); f32 convolutions
// always run on Eigen.
//
//   build-cpu/bench/bench_cpu_conv --benchmark_filter=conv2
//
// Names: conv<layer>/<dtype>/<forward|data|weight>/<onednn|eigen>,
// pool<layer>/<dtype>, cast/<from>_to_<to>.
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <functional>
#include <string>

#include "tensor/backend_settings.h"
#include "tensor/ops.h"

namespace mpt {
namespace {

struct Layer {
  int64_t in, out, size;  // channels in and out, image height and width
};
constexpr int64_t kBatch = 128;
const Layer kLayers[] = {{1, 32, 28}, {32, 64, 14}};

void conv_bench(benchmark::State& state, const Layer& l, DType dt, const std::string& pass, bool onednn) {
  Generator gen(1);
  const Conv2dParams p{.pad_h = 1, .pad_w = 1};
  const Tensor x = randn({kBatch, l.in, l.size, l.size}, dt, kCPU, &gen);
  const Tensor w = randn({l.out, l.in, 3, 3}, dt, kCPU, &gen);
  const Tensor dy = randn({kBatch, l.out, l.size, l.size}, dt, kCPU, &gen);
  set_cpu_onednn(onednn ? CpuOnednn::kWhereFaster : CpuOnednn::kNever);
  for (auto _ : state) {
    Tensor r = pass == "forward" ? prim::conv2d(x, w, p)
               : pass == "data"  ? prim::conv2d_backward_data(dy, w, x.shape(), p)
                                 : prim::conv2d_backward_weight(x, dy, w.shape(), p);
    benchmark::DoNotOptimize(r);
  }
  set_cpu_onednn(CpuOnednn::kWhereFaster);
  state.SetItemsProcessed(kBatch * l.out * l.in * 9 * l.size * l.size * state.iterations());  // multiply-adds
}

void pool_bench(benchmark::State& state, const Layer& l, DType dt) {
  Generator gen(1);
  const Tensor x = randn({kBatch, l.out, l.size, l.size}, dt, kCPU, &gen);
  for (auto _ : state) {
    auto result = prim::max_pool2d(x, Pool2dParams{});
    benchmark::DoNotOptimize(result);
  }
  state.SetItemsProcessed(x.numel() * state.iterations());
}

// The default MLP's weights (784x1024 + 1024x1024 + 1024x10), as autocast
// casts them each step.
void cast_bench(benchmark::State& state, DType from, DType to) {
  Generator gen(1);
  const Tensor src = randn({1024 * (784 + 1024 + 10)}, from, kCPU, &gen);
  const Tensor dst = Tensor::empty(src.shape(), to);
  for (auto _ : state) prim::copy_(dst, src);
  state.SetBytesProcessed(static_cast<int64_t>(src.nbytes() + dst.nbytes()) * state.iterations());
}

void add(const std::string& name, const std::function<void(benchmark::State&)>& f) {
  benchmark::RegisterBenchmark(name.c_str(), f)->Unit(benchmark::kMillisecond)->UseRealTime();
}

const bool registered = [] {
  for (int i = 0; i < 2; ++i) {
    const Layer& l = kLayers[i];
    const std::string layer = std::to_string(i + 1);
    for (DType dt : {DType::f32, DType::bf16}) {
      for (const char* pass : {"forward", "data", "weight"})
        for (bool onednn : {true, false}) {
          if (dt == DType::f32 && !onednn) continue;  // f32 convolutions are Eigen's either way
          const bool on_onednn = dt == DType::bf16 && onednn;
          add(fmt::format("conv{}/{}/{}/{}", layer, dtype_name(dt), pass, on_onednn ? "onednn" : "eigen"),
              [&l, dt, pass, onednn](benchmark::State& s) { conv_bench(s, l, dt, pass, onednn); });
        }
      add(fmt::format("pool{}/{}", layer, dtype_name(dt)), [&l, dt](benchmark::State& s) { pool_bench(s, l, dt); });
    }
  }
  add("cast/f32_to_bf16", [](benchmark::State& s) { cast_bench(s, DType::f32, DType::bf16); });
  add("cast/bf16_to_f32", [](benchmark::State& s) { cast_bench(s, DType::bf16, DType::f32); });
  return true;
}();

}  // namespace
}  // namespace mpt

BENCHMARK_MAIN();
