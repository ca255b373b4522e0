// The CPU backend's matrix products on the reference models' shapes and on
// small ones, through oneDNN and through Eigen (the same prim::matmul, with
// oneDNN turned off for the second), f32 and bf16. What decides where
// products go (CpuOnednn::kWhereFaster, tensor/backend_settings.h).
//
//   build/bench/bench_cpu_gemm --benchmark_filter=mlp
//
// Names: <shape>/<dtype>/<eigen|onednn>; the shapes are m x k x n with the
// operands laid out as the layer's forward (x @ w^T), input gradient
// (dy @ w) and weight gradient (dy^T @ x) read them.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <string>

#include "tensor/backend_settings.h"
#include "tensor/ops.h"

namespace mpt {
namespace {

// [batch,] a [m, k], read transposed (a stored [k, m]) where `a_t`; b
// likewise; batch 0: 2-d operands.
void product(benchmark::State& state, int64_t batch, int64_t m, int64_t k, int64_t n, bool a_t, bool b_t, DType dtype,
             bool onednn) {
  Generator gen(1);
  auto matrix = [&](int64_t rows, int64_t cols, bool transposed) {
    Shape s = transposed ? Shape{cols, rows} : Shape{rows, cols};
    if (batch > 0) s.insert(s.begin(), batch);
    const Tensor t = randn(s, dtype, kCPU, &gen);
    const auto last = static_cast<int64_t>(s.size()) - 1;
    return transposed ? prim::transpose(t, last - 1, last) : t;
  };
  const Tensor a = matrix(m, k, a_t), b = matrix(k, n, b_t);
  set_cpu_onednn(onednn ? CpuOnednn::kAlways : CpuOnednn::kNever);
  for (auto _ : state) benchmark::DoNotOptimize(prim::matmul(a, b));
  set_cpu_onednn(CpuOnednn::kWhereFaster);
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * static_cast<double>(std::max<int64_t>(batch, 1) * m * k * n), benchmark::Counter::kIsIterationInvariantRate,
                         benchmark::Counter::kIs1000);
}

void add(const std::string& name, int64_t batch, int64_t m, int64_t k, int64_t n, bool a_t, bool b_t) {
  for (DType dtype : {DType::f32, DType::bf16})
    for (bool onednn : {false, true}) {
      if (onednn && !cpu_onednn_usable()) continue;
      const std::string full = name + "/" + dtype_name(dtype) + (onednn ? "/onednn" : "/eigen");
      benchmark::RegisterBenchmark(full.c_str(), [=](benchmark::State& s) { product(s, batch, m, k, n, a_t, b_t, dtype, onednn); })
          ->Unit(benchmark::kMicrosecond)->UseRealTime();
    }
}

const bool registered = [] {
  for (int64_t s : {8, 16, 24, 32, 48, 64, 96, 128})
    add("square_" + std::to_string(s), 0, s, s, s, false, false);
  // The default job's MLP, 784-1024-1024-10, batch 128; and batch 64.
  for (int64_t rows : {64, 128}) {
    const std::string r = "mlp_b" + std::to_string(rows);
    add(r + "_fc1_forward", 0, rows, 784, 1024, false, true);
    add(r + "_fc2_forward", 0, rows, 1024, 1024, false, true);
    add(r + "_head_forward", 0, rows, 1024, 10, false, true);
    add(r + "_fc2_input_grad", 0, rows, 1024, 1024, false, false);
    add(r + "_head_input_grad", 0, rows, 10, 1024, false, false);
    add(r + "_fc1_weight_grad", 0, 1024, rows, 784, true, false);
    add(r + "_head_weight_grad", 0, 10, rows, 1024, true, false);
  }
  // gpt_mini (d 384, 64 x 256 tokens): the MLP's first layer each way, the
  // head, and one attention head's scores.
  add("gpt_fc_forward", 0, 16384, 384, 1536, false, true);
  add("gpt_fc_input_grad", 0, 16384, 1536, 384, false, false);
  add("gpt_fc_weight_grad", 0, 1536, 16384, 384, true, false);
  add("gpt_head_forward", 0, 16384, 384, 65, false, true);
  add("gpt_scores_one_head", 0, 256, 64, 256, false, true);
  // Attention's products over all 64 x 6 heads: scores q @ k^T, then
  // probabilities @ v.
  add("gpt_scores", 384, 256, 64, 256, false, true);
  add("gpt_attention_values", 384, 256, 256, 64, false, false);
  return true;
}();

}  // namespace
}  // namespace mpt

BENCHMARK_MAIN();
