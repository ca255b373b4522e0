// FP8 on the GPU against the CPU on fresh random inputs: the quantizing
// kernels bit for bit (codes, transposes, amax, 1/scale; both formats, every
// input dtype, tiled and ragged shapes), cuBLASLt's FP8 products against the
// CPU's decoded f32 products, the FP8 linear layer forward and backward over
// steps of delayed scaling (the scales bit for bit), the prologues folded
// into the quantization and the fused MLP against their unfused ops on the
// GPU bit for bit, and capture in a CUDA graph. Every test skips without a GPU; the products skip on GPUs older
// than compute capability 8.9, which must refuse them by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "amp/fp8_linear.h"
#include "amp/fp8_scaling.h"
#include "autograd/engine.h"
#include "autograd/ops.h"
#include "models/adamw.h"
#include "models/layers.h"
#include "models/mlp.h"
#include "tensor/cuda/graph.h"
#include "tensor/cuda_info.h"
#include "tensor/fp8.h"
#include "tensor/ops.h"
#include "tensor/stream.h"
#include "tests/fp8_mlp_run.h"
#include "tests/fp8_test_values.h"
#include "tests/test_util.h"
#include "train/mixed_precision.h"

namespace mpt {
namespace {

using amp::Fp8Group;
using testing::fresh_seed;
using testing::bytes_of;
using testing::random_codes;
using testing::rel_error;
using testing::spread_values;

const Device kGPU{DeviceType::cuda, 0};

bool fp8_gemm_capable() {
  const cuda::DeviceProperties p = cuda::device_properties(0);
  return p.compute_major > 8 || (p.compute_major == 8 && p.compute_minor >= 9);
}

#define SKIP_WITHOUT_FP8_GEMM()                                                                       \
  MPT_SKIP_WITHOUT_CUDA();                                                                            \
  if (!fp8_gemm_capable()) {                                                                          \
    const Tensor a = zeros({16, 16}, DType::e4m3, kGPU), one = ones({1}, DType::f32, kGPU);           \
    testing::expect_contains(testing::error_of<DeviceError>([&] {                                     \
                               prim::gemm_fp8(a, one, a, one, Tensor(), DType::bf16, false);          \
                             }),                                                                      \
                             {"compute capability", "8.9"});                                         \
    GTEST_SKIP() << "skipped: FP8 products need compute capability 8.9";                              \
  }

TEST(CudaFp8, QuantizeMatchesTheCpuBitForBit) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  std::mt19937_64 rng(seed);
  for (DType in_dtype : {DType::f32, DType::bf16, DType::f16})
    for (DType format : {DType::e4m3, DType::e5m2})
      // 16448 rows: 257 blocks of rows, more partial column sums than the
      // GPU's finishing pass stages at once.
      for (auto [rows, cols] :
           {std::pair<int64_t, int64_t>{128, 192}, {48, 80}, {5, 7}, {1040, 16}, {2112, 48}, {4160, 32}, {16448, 48}})
        for (bool specials : {false, true}) {
          SCOPED_TRACE(fmt::format("{} -> {} [{}, {}] specials {}", dtype_name(in_dtype), dtype_name(format), rows,
                                   cols, specials));
          const Tensor in = prim::to(from_vector(spread_values(rows * cols, rng, specials), {rows, cols}), in_dtype);
          const float s = std::ldexp(1.0f, static_cast<int>(rng() % 16) - 8) * 1.37f;
          const Tensor scale = from_vector(std::vector<float>{s}, {1});
          const Tensor amax_cpu = from_vector(std::vector<float>{0.5f}, {1});
          const Tensor amax_gpu = prim::to(amax_cpu, kGPU);
          // Half the time with a ReLU's backward as prologue (its output as
          // aux), and the column sums. (GELU's prologues go through erf and
          // tanh, whose last bits the two devices' libraries need not share:
          // ProloguesGiveTheCodesOfTheOpThenTheQuantization.)
          const bool masked = rng() % 2 == 0;
          const Fp8Prologue prologue = masked ? Fp8Prologue::relu_backward : Fp8Prologue::none;
          const Tensor mask = masked ? prim::to(from_vector(spread_values(rows * cols, rng, false), {rows, cols}), in_dtype)
                                     : Tensor();
          const prim::Fp8Quantized c = prim::quantize_fp8(in, format, scale, amax_cpu, true, prologue, mask, true);
          const prim::Fp8Quantized g = prim::quantize_fp8(prim::to(in, kGPU), format, prim::to(scale, kGPU), amax_gpu,
                                                          true, prologue, masked ? prim::to(mask, kGPU) : Tensor(), true);
          ASSERT_EQ(bytes_of(g.data), bytes_of(c.data)) << "codes";
          ASSERT_EQ(bytes_of(g.data_t), bytes_of(c.data_t)) << "transposed codes";
          // NaN's payload differs (the GPU widens a 16-bit NaN to 0x7FFFFFFF).
          const float amax_g = amax_gpu.item(), amax_c = amax_cpu.item();
          if (std::isnan(amax_c)) EXPECT_TRUE(std::isnan(amax_g)) << "amax";
          else EXPECT_EQ(bytes_of(amax_gpu), bytes_of(amax_cpu)) << "amax";
          EXPECT_EQ(bytes_of(g.scale_inv), bytes_of(c.scale_inv)) << "1 / scale";
          const std::vector<float> sums_g = g.column_sums.to_vector<float>(), sums_c = c.column_sums.to_vector<float>();
          for (size_t i = 0; i < sums_c.size(); ++i)
            if (!(std::isnan(sums_c[i]) && std::isnan(sums_g[i])))
              ASSERT_EQ(std::bit_cast<uint32_t>(sums_g[i]), std::bit_cast<uint32_t>(sums_c[i])) << "column sum " << i;
        }
}

// Each prologue folded into the quantizing kernels gives, bit for bit, the
// codes, amax and column sums of the element-wise kernel's pass followed by
// the plain quantization: every input dtype, tiled and ragged shapes.
TEST(CudaFp8, ProloguesGiveTheCodesOfTheOpThenTheQuantization) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  std::mt19937_64 rng(seed);
  for (Fp8Prologue p : {Fp8Prologue::relu_backward, Fp8Prologue::gelu_erf, Fp8Prologue::gelu_tanh,
                        Fp8Prologue::gelu_erf_backward, Fp8Prologue::gelu_tanh_backward})
    for (DType dtype : {DType::f32, DType::bf16, DType::f16})
      for (const auto& shape : {std::pair<int64_t, int64_t>{256, 192}, {4160, 32}, {5, 7}}) {
        // Named copies, not a structured binding: the lambda below captures
        // them, which clang 14 refuses for bindings.
        const int64_t rows = shape.first, cols = shape.second;
        SCOPED_TRACE(fmt::format("{} {} [{}, {}]", fp8_prologue_name(p), dtype_name(dtype), rows, cols));
        auto values = [&](bool specials) {
          return prim::to(prim::to(from_vector(spread_values(rows * cols, rng, specials), {rows, cols}), dtype), kGPU);
        };
        const Tensor in = values(true), aux = fp8_prologue_has_aux(p) ? values(false) : Tensor();
        const Tensor scale = full({1}, 0.75, DType::f32, kGPU);
        const Tensor amax_fused = zeros({1}, DType::f32, kGPU), amax_plain = zeros({1}, DType::f32, kGPU);
        const prim::Fp8Quantized fused = prim::quantize_fp8(in, DType::e5m2, scale, amax_fused, true, p, aux, true);
        const prim::Fp8Quantized plain = prim::quantize_fp8(prim::fp8_prologue(p, in, aux), DType::e5m2, scale,
                                                            amax_plain, true, Fp8Prologue::none, Tensor(), true);
        ASSERT_EQ(bytes_of(fused.data), bytes_of(plain.data)) << "codes";
        ASSERT_EQ(bytes_of(fused.data_t), bytes_of(plain.data_t)) << "transposed codes";
        EXPECT_EQ(bytes_of(amax_fused), bytes_of(amax_plain)) << "amax";
        EXPECT_EQ(bytes_of(fused.column_sums), bytes_of(plain.column_sums)) << "column sums";
      }
}

// The fused MLP against fp8_linear, gelu, fp8_linear on the GPU, bit for
// bit: outputs, the five gradients and the scaling state over steps of
// both recipes, both GELU forms, GPT-2 small's MLP proportions, and a shape
// that falls back to 16 bits.
TEST(CudaFp8, MlpMatchesTheTwoLayersAndGeluBitForBit) {
  SKIP_WITHOUT_FP8_GEMM();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  testing::expect_fp8_mlp_is_the_ops(kGPU, {{512, 192, 768, 192}, {10, 32, 64, 16}}, seed);
}

TEST(CudaFp8, ProductsMatchTheCpu) {
  SKIP_WITHOUT_FP8_GEMM();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  std::mt19937_64 rng(seed);
  for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{64, 96, 128}, {256, 512, 1024}, {16, 16, 16}})
    for (auto [fa, fb] : {std::pair{DType::e4m3, DType::e4m3}, {DType::e5m2, DType::e4m3}})
      for (DType out_dtype : {DType::f32, DType::bf16, DType::f16})
        for (bool fast : {false, true}) {
          SCOPED_TRACE(fmt::format("[{}, {}, {}] {} x {} -> {} fast {}", m, n, k, dtype_name(fa), dtype_name(fb),
                                   dtype_name(out_dtype), fast));
          // Small codes only, so that sums of k products stay within f16.
          Tensor a = random_codes(m, k, fa, rng), b = random_codes(n, k, fb, rng);
          const Tensor sa = from_vector(std::vector<float>{1.0f / 4096}, {1});
          const Tensor sb = from_vector(std::vector<float>{1.0f / 64}, {1});
          Tensor bias = prim::to(from_vector(spread_values(n, rng, false), {n}), out_dtype);
          const Tensor cpu = prim::gemm_fp8(a, sa, b, sb, bias, out_dtype, fast);
          const Tensor gpu = prim::gemm_fp8(prim::to(a, kGPU), prim::to(sa, kGPU), prim::to(b, kGPU),
                                            prim::to(sb, kGPU), prim::to(bias, kGPU), out_dtype, fast);
          const std::vector<double> c = cpu.to_vector<double>(), g = gpu.to_vector<double>();
          ASSERT_TRUE(testing::all_finite(c));
          // The FP8 products themselves are exact in f32, but Hopper's FP8
          // tensor cores add them in a narrower fixed-point accumulator
          // before each promotion to f32 (and with fast accumulation
          // never promote): e5m2's wider exponents lose the most (2-4e-5
          // seen on an H100 with promotion).
          const double tol = out_dtype == DType::f32 ? (fast ? 1e-3 : 1e-4) : 1e-2;
          EXPECT_LT(rel_error(g, c), tol);
        }
}

// The recipe's forward_fast_accumulation reaches the forward product: the
// layer's output is, bit for bit, the product of its quantized operands
// summed as the recipe asks. At k = 4096 the two accumulators round
// differently (ProductsMatchTheCpu's tolerances), so a recipe that did not
// reach the product would fail one of the two.
TEST(CudaFp8, LinearForwardSumsAsTheRecipeAsks) {
  SKIP_WITHOUT_FP8_GEMM();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  Generator gen(seed);
  const Tensor x = prim::to(randn({128, 4096}, DType::f32, kCPU, &gen), kGPU);
  const Tensor w = prim::to(prim::mul_scalar(randn({64, 4096}, DType::f32, kCPU, &gen), 0.02), kGPU);
  std::vector<std::vector<uint8_t>> outputs;
  for (bool fast : {true, false}) {
    SCOPED_TRACE(fast ? "fast accumulation" : "promoted to f32");
    amp::Fp8Recipe recipe;
    recipe.scaling = amp::Fp8ScalingMode::current;  // the scales from these tensors alone
    recipe.forward_fast_accumulation = fast;
    amp::Fp8LinearState layer = amp::Fp8LinearState::for_layer(std::make_shared<amp::Fp8Scaling>(recipe, kGPU));
    const Tensor y = amp::fp8_linear(x, w, Tensor(), layer, DType::f16);
    // The same quantizations on a state of their own, then the product.
    amp::Fp8LinearState twin = amp::Fp8LinearState::for_layer(std::make_shared<amp::Fp8Scaling>(recipe, kGPU));
    const prim::Fp8Quantized wq = twin.scaling->quantize(amp::Fp8Group::forward, twin.weight_slot, w, true);
    const prim::Fp8Quantized xq = twin.scaling->quantize(amp::Fp8Group::forward, twin.input_slot, x, false);
    const Tensor expected = prim::gemm_fp8(xq.data, xq.scale_inv, wq.data, wq.scale_inv, Tensor(), DType::f16, fast);
    EXPECT_EQ(bytes_of(y), bytes_of(expected));
    outputs.push_back(bytes_of(y));
  }
  EXPECT_NE(outputs[0], outputs[1]) << "the two accumulators gave the same bits";
}

// One layer's three products over steps of delayed scaling, on both
// devices from the same values: outputs and gradients within the products'
// rounding, scales and histories bit for bit.
TEST(CudaFp8, LinearOverDelayedScalingStepsMatchesTheCpu) {
  SKIP_WITHOUT_FP8_GEMM();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  std::mt19937_64 rng(seed);
  amp::Fp8Recipe recipe;
  recipe.history_length = 4;
  for (amp::Fp8ScalingMode mode : {amp::Fp8ScalingMode::delayed, amp::Fp8ScalingMode::current}) {
    recipe.scaling = mode;
    SCOPED_TRACE(amp::fp8_scaling_mode_name(mode));
    auto cpu_scaling = std::make_shared<amp::Fp8Scaling>(recipe, kCPU);
    auto gpu_scaling = std::make_shared<amp::Fp8Scaling>(recipe, kGPU);
    amp::Fp8LinearState cpu_state = amp::Fp8LinearState::for_layer(cpu_scaling);
    amp::Fp8LinearState gpu_state = amp::Fp8LinearState::for_layer(gpu_scaling);
    const int64_t rows = 64, in = 96, out = 48;
    std::normal_distribution<float> normal(0.0f, 1.0f);
    auto randoms = [&](size_t count, float s) {
      std::vector<float> v(count);
      for (auto& e : v) e = normal(rng) * s;
      return v;
    };
    Tensor w_cpu = from_vector(randoms(out * in, 0.05f), {out, in}).set_requires_grad(true);
    Tensor b_cpu = from_vector(randoms(out, 0.1f), {out}).set_requires_grad(true);
    Tensor w_gpu = prim::to(w_cpu, kGPU).set_requires_grad(true);
    Tensor b_gpu = prim::to(b_cpu, kGPU).set_requires_grad(true);
    for (int step = 0; step < 4; ++step) {
      SCOPED_TRACE(step);
      const std::vector<float> xv = randoms(rows * in, 2.0f + step), gv = randoms(rows * out, 1e-4f);
      Tensor x_cpu = from_vector(xv, {rows, in}).set_requires_grad(true);
      Tensor x_gpu = prim::to(x_cpu, kGPU).set_requires_grad(true);
      const bool relu = step % 2 == 1;
      const Tensor y_cpu = amp::fp8_linear(x_cpu, w_cpu, b_cpu, cpu_state, DType::bf16, relu);
      const Tensor y_gpu = amp::fp8_linear(x_gpu, w_gpu, b_gpu, gpu_state, DType::bf16, relu);
      backward(sum(mul(to(y_cpu, DType::f32), from_vector(gv, {rows, out}))));
      backward(sum(mul(to(y_gpu, DType::f32), from_vector(gv, {rows, out}, kGPU))));
      const std::vector<double> yg = y_gpu.to_vector<double>(), yc = y_cpu.to_vector<double>();
      EXPECT_LT(rel_error(yg, yc), 1e-2) << "y";
      // With the ReLU, an output near 0 that rounds to 0 (or below) on one
      // device only masks its gradient there alone: such flips must be rare,
      // and each moves the gradients by one element's share. Without it the
      // gradients differ by the products' accumulation only.
      size_t flips = 0;
      for (size_t i = 0; i < yg.size(); ++i) flips += (yg[i] > 0) != (yc[i] > 0);
      EXPECT_LE(flips, yg.size() / 100) << "outputs positive on one device only";
      const double loose = flips ? 5e-2 : 1e-2;
      EXPECT_LT(rel_error(x_gpu.grad().to_vector<double>(), x_cpu.grad().to_vector<double>()), loose) << "dx";
      // dW: the FP8 tensor cores' accumulator (see ProductsMatchTheCpu).
      EXPECT_LT(rel_error(w_gpu.grad().to_vector<double>(), w_cpu.grad().to_vector<double>()), flips ? 5e-2 : 2e-4)
          << "dW";
      // db: f32 sums in one order on both devices, of the same values.
      if (flips) EXPECT_LT(rel_error(b_gpu.grad().to_vector<double>(), b_cpu.grad().to_vector<double>()), 5e-2) << "db";
      else EXPECT_EQ(b_gpu.grad().to_vector<float>(), b_cpu.grad().to_vector<float>()) << "db";
      cpu_scaling->update();
      gpu_scaling->update();
      for (size_t i = 0; i < cpu_scaling->state().size(); ++i)
        EXPECT_EQ(bytes_of(gpu_scaling->state()[i].second), bytes_of(cpu_scaling->state()[i].second))
            << cpu_scaling->state()[i].first;
      // A step of plain SGD, the same on both, so the weights' copies renew.
      for (auto [wc, wg] : {std::pair{&w_cpu, &w_gpu}, {&b_cpu, &b_gpu}}) {
        prim::copy_(*wc, prim::sub(*wc, prim::mul_scalar(wc->grad(), 0.5)));
        wc->bump_version();
        prim::copy_(*wg, prim::to(*wc, kGPU));
        wg->bump_version();
        wc->set_grad(Tensor());
        wg->set_grad(Tensor());
      }
    }
  }
}

// Delayed scaling's per-step update on the GPU (a warp per tensor sharing
// the history's max) against the CPU's loop, bit for bit: histories
// shorter and longer than a warp, both reductions, slots spread over
// several blocks, and amaxes of 0, inf and NaN among the random ones.
TEST(CudaFp8, DelayedUpdateMatchesTheCpuBitForBit) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> exponent(-30.0f, 30.0f);
  std::uniform_int_distribution<int> pick(0, 19);
  const float specials[] = {0.0f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
  for (const auto& [history, reduction] : {std::pair{int64_t{5}, amp::AmaxReduction::max},
                                           {int64_t{37}, amp::AmaxReduction::max},
                                           {int64_t{1024}, amp::AmaxReduction::max},
                                           {int64_t{70}, amp::AmaxReduction::most_recent}}) {
    SCOPED_TRACE(history);
    amp::Fp8Recipe recipe;
    recipe.history_length = history;
    recipe.reduction = reduction;
    recipe.margin = 1.0f;
    amp::Fp8Scaling cpu(recipe, kCPU), gpu(recipe, kGPU);
    const int64_t slots = 9;  // three blocks of warps, the last one part full
    for (amp::Fp8Scaling* s : {&cpu, &gpu}) {
      s->add_slots(Fp8Group::forward, slots);
      s->add_slots(Fp8Group::backward, 2);
    }
    for (int step = 0; step < 90; ++step) {
      for (Fp8Group group : {Fp8Group::forward, Fp8Group::backward}) {
        std::vector<float> amax(static_cast<size_t>(cpu.slots(group)));
        for (float& a : amax) {
          const int p = pick(rng);
          a = p < 3 ? specials[p] : std::exp2(exponent(rng));
        }
        prim::copy_(cpu.amax(group), from_vector(amax, {cpu.slots(group)}));
        prim::copy_(gpu.amax(group), from_vector(amax, {gpu.slots(group)}, kGPU));
      }
      cpu.update();
      gpu.update();
    }
    for (size_t i = 0; i < cpu.state().size(); ++i)
      EXPECT_EQ(bytes_of(gpu.state()[i].second), bytes_of(cpu.state()[i].second)) << cpu.state()[i].first;
    // The rule ran: some scales moved away from 1.
    const std::vector<float> scales = cpu.scale(Fp8Group::forward).to_vector<float>();
    EXPECT_TRUE(std::any_of(scales.begin(), scales.end(), [](float s) { return s != 1.0f; }));
  }
}

// FP8 training on the GPU (train::MixedPrecision, delayed scaling): with
// the weights' FP8 copies written by AdamW's step and with the copies made
// at each forward, the same weights and scaling state bit for bit, with
// host and with device step counts; right after a step the copies are
// current only in the first.
TEST(CudaFp8, CopiesWrittenByTheOptimizerTrainAsCopiesMadeInTheForward) {
  SKIP_WITHOUT_FP8_GEMM();
  struct Run {
    std::vector<std::vector<uint8_t>> weights, scaling;
    int current_after_step = 0;
  };
  auto train = [](bool in_optimizer, bool capturable) {
    Generator gen(7);
    std::shared_ptr<nn::Sequential> model = nn::make_mlp({.in_features = 32, .hidden = {64, 48}, .num_classes = 3}, &gen);
    model->to(kGPU);
    optim::AdamW optimizer(model->parameters(), optim::AdamWOptions{1e-2, 0.9, 0.99, 1e-8, 0.1});
    optimizer.set_capturable(capturable);
    train::StepOptions options;
    options.precision = train::Precision::fp8;
    options.fp8.history_length = 4;
    options.fp8_copies_in_optimizer = in_optimizer;
    train::MixedPrecision precision(options, optimizer, DeviceType::cuda);
    precision.attach_fp8(*model, kGPU);
    std::mt19937_64 rng(9);
    Generator data(9);
    Run run;
    for (int step = 0; step < 5; ++step) {
      const Tensor x = prim::to(randn({64, 32}, DType::f32, kCPU, &data), kGPU);
      std::vector<int64_t> labels(64);
      for (int64_t& l : labels) l = static_cast<int64_t>(rng() % 3);
      const Tensor y = from_vector(labels, {64}, DType::i64, kGPU);
      const Tensor loss = precision.forward([&] { return cross_entropy(to(model->forward(x), DType::f32), y); });
      precision.backward(loss);
      precision.step();
      optimizer.zero_grad();
      for (const auto& [name, m] : model->named_modules())
        if (auto* linear = dynamic_cast<nn::Linear*>(m); linear && linear->fp8)
          run.current_after_step += linear->fp8->weight_version == linear->weight.version();
    }
    // One more forward: without the optimizer's copies the layers make
    // theirs now, and only then record the weights' amaxes of this step.
    const Tensor x = prim::to(randn({64, 32}, DType::f32, kCPU, &data), kGPU);
    (void)precision.forward([&] { return model->forward(x); });
    for (const Tensor& p : model->parameters()) run.weights.push_back(bytes_of(p));
    for (const auto& [name, t] : precision.fp8_scaling()->state()) run.scaling.push_back(bytes_of(t));
    return run;
  };
  for (bool capturable : {false, true}) {
    SCOPED_TRACE(capturable ? "capturable" : "host steps");
    const Run fused = train(true, capturable), lazy = train(false, capturable);
    EXPECT_EQ(fused.weights, lazy.weights);
    EXPECT_EQ(fused.scaling, lazy.scaling);
    EXPECT_EQ(fused.current_after_step, 2 * 5) << "both FP8 layers' copies written by every step";
    EXPECT_EQ(lazy.current_after_step, 0);
  }
}

TEST(CudaFp8, QuantizeAndProductReplayInACudaGraph) {
  SKIP_WITHOUT_FP8_GEMM();
  std::mt19937_64 rng(fresh_seed());
  const Stream stream = Stream::create(kGPU);
  StreamGuard on_stream(stream);
  amp::Fp8Scaling scaling(amp::Fp8Recipe{}, kGPU);
  scaling.add_slots(Fp8Group::forward, 2);
  Tensor x = prim::to(from_vector(spread_values(64 * 32, rng, false), {64, 32}), kGPU);
  const Tensor w = prim::to(from_vector(spread_values(16 * 32, rng, false), {16, 32}), kGPU);
  Tensor y;
  auto step = [&] {
    const prim::Fp8Quantized xq = scaling.quantize(Fp8Group::forward, 0, x, false);
    const prim::Fp8Quantized wq = scaling.quantize(Fp8Group::forward, 1, w, false);
    y = prim::gemm_fp8(xq.data, xq.scale_inv, wq.data, wq.scale_inv, Tensor(), DType::f32, false);
    scaling.update();
  };
  step();  // warm: plans and kernels made outside the capture
  cuda::Graph graph(0);
  graph.capture(step);
  const Tensor captured_y = y;
  for (int replay = 0; replay < 3; ++replay) {
    prim::copy_(x, prim::to(from_vector(spread_values(64 * 32, rng, false), {64, 32}), kGPU));
    const std::vector<float> scales_before = scaling.scale(Fp8Group::forward).to_vector<float>();
    graph.replay();
    stream.synchronize();
    // The same math eagerly, from the scales the replay started with.
    const Tensor sx = from_vector(std::vector<float>{scales_before[0]}, {1}, kGPU);
    const Tensor sw = from_vector(std::vector<float>{scales_before[1]}, {1}, kGPU);
    const prim::Fp8Quantized xq = prim::quantize_fp8(x, DType::e4m3, sx, Tensor(), false);
    const prim::Fp8Quantized wq = prim::quantize_fp8(w, DType::e4m3, sw, Tensor(), false);
    const Tensor eager = prim::gemm_fp8(xq.data, xq.scale_inv, wq.data, wq.scale_inv, Tensor(), DType::f32, false);
    EXPECT_EQ(bytes_of(captured_y), bytes_of(eager)) << "replay " << replay;
  }
}

}  // namespace
}  // namespace mpt
