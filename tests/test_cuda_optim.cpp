// The fused multi-tensor optimizer kernels on the GPU against the raw-op
// rules on the CPU: the same parameters and gradients, several steps, many
// tensors of awkward sizes (so launches split across tensor lists and
// chunks), per dtype tolerance; and, bit for bit, against the CPU's fused
// loops.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <random>

#include "amp/fp8_linear.h"
#include "amp/fp8_scaling.h"
#include "models/adamw.h"
#include "models/sgd.h"
#include "tensor/ops.h"
#include "tests/fp8_test_values.h"
#include "tests/optimizer_check.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

using amp::Fp8Group;
using testing::awkward_shapes;
using testing::bytes_of;
using testing::host_f64;
using testing::MakeOptimizer;
using testing::rel_error;

const Device kGPU("cuda:0");

// A run on the GPU (fused or not) against the raw-op rule on the CPU.
void expect_gpu_matches_cpu(const MakeOptimizer& make, DType dt, bool fused, double tol) {
  testing::expect_update_matches_raw_ops(make, kGPU, dt, fused, tol);
}

TEST(CudaOptim, FusedAdamWMatchesTheCpu) {
  MPT_SKIP_WITHOUT_CUDA();
  const MakeOptimizer make = [](std::vector<Tensor> p) {
    return std::make_unique<optim::AdamW>(std::move(p), optim::AdamWOptions{1e-2, 0.9, 0.99, 1e-8, 0.1});
  };
  for (bool fused : {true, false}) expect_gpu_matches_cpu(make, DType::f32, fused, 1e-5);
  expect_gpu_matches_cpu(make, DType::bf16, true, 2e-2);
  expect_gpu_matches_cpu(make, DType::f16, true, 5e-3);
  // A weight decay that makes a quarter of each update.
  const MakeOptimizer decaying = [](std::vector<Tensor> p) {
    return std::make_unique<optim::AdamW>(std::move(p), optim::AdamWOptions{1e-2, 0.9, 0.99, 1e-8, 5.0});
  };
  expect_gpu_matches_cpu(decaying, DType::bf16, true, 2e-2);
  expect_gpu_matches_cpu(decaying, DType::f16, true, 5e-3);
}

// The host loops (the CPU's fused path) and the CUDA kernels spell out the
// same roundings: on the same f32 values they give the same bits.
TEST(CudaOptim, FusedUpdatesOnTheHostEqualTheKernelsBitForBit) {
  MPT_SKIP_WITHOUT_CUDA();
  const std::vector<std::pair<const char*, MakeOptimizer>> rules = {
      {"AdamW",
       [](std::vector<Tensor> p) {
         return std::make_unique<optim::AdamW>(std::move(p), optim::AdamWOptions{1e-2, 0.9, 0.99, 1e-8, 0.1});
       }},
      {"SGD with dampened momentum",
       [](std::vector<Tensor> p) {
         return std::make_unique<optim::SGD>(std::move(p), optim::SGDOptions{0.05, 0.9, 0.1, 1e-3, false});
       }},
      {"SGD, Nesterov",
       [](std::vector<Tensor> p) {
         return std::make_unique<optim::SGD>(std::move(p), optim::SGDOptions{0.05, 0.9, 0.0, 1e-3, true});
       }}};
  for (const auto& [name, make] : rules) {
    const uint64_t seed = testing::fresh_seed();
    SCOPED_TRACE(::testing::Message() << name << ", seed " << seed);
    Generator gen(seed);
    std::vector<Tensor> cpu, gpu;
    for (const Shape& s : awkward_shapes()) {
      const Tensor p = randn(s, DType::f32, kCPU, &gen);
      cpu.push_back(prim::clone(p).set_requires_grad(true));
      gpu.push_back(prim::to(p, kGPU).set_requires_grad(true));
    }
    auto on_cpu = make(cpu), on_gpu = make(gpu);
    for (int step = 0; step < 3; ++step) {
      for (size_t i = 0; i < cpu.size(); ++i) {
        const Tensor g = randn(cpu[i].shape(), DType::f32, kCPU, &gen);
        cpu[i].set_grad(g);
        gpu[i].set_grad(prim::to(g, kGPU));
      }
      on_cpu->step();
      on_gpu->step();
    }
    for (size_t i = 0; i < cpu.size(); ++i) EXPECT_EQ(host_f64(gpu[i]), host_f64(cpu[i])) << "parameter " << i;
    const optim::StateDict state_gpu = on_gpu->state_dict();
    for (const auto& [key, t] : on_cpu->state_dict()) EXPECT_EQ(host_f64(state_gpu.at(key)), host_f64(t)) << key;
  }
}

TEST(CudaOptim, CapturableAdamWMatchesTheCpu) {
  MPT_SKIP_WITHOUT_CUDA();
  // Step counts on the device, bias corrections computed in the kernel.
  const MakeOptimizer make = [](std::vector<Tensor> p) {
    const bool on_gpu = p.front().device().is_cuda();  // the CPU side is the raw-op reference
    auto opt = std::make_unique<optim::AdamW>(std::move(p), optim::AdamWOptions{1e-2, 0.9, 0.99, 1e-8, 0.1});
    if (on_gpu) opt->set_capturable(true);
    return opt;
  };
  expect_gpu_matches_cpu(make, DType::f32, true, 1e-5);
  expect_gpu_matches_cpu(make, DType::bf16, true, 2e-2);
}

// Capturable AdamW's bias corrections, worked out on the device, come from
// the betas as given: its first update from zero is the host-corrected one
// to f32's rounding. (From beta2 rounded to f32 it was 6.4e-6 too small.)
TEST(CudaOptim, CapturableAdamWCorrectsWithTheBetasAsGiven) {
  MPT_SKIP_WITHOUT_CUDA();
  Generator gen(testing::fresh_seed());
  const Tensor grad = randn({4096}, DType::f32, kGPU, &gen);
  auto first_update = [&](bool capturable) {
    Tensor p = zeros({4096}, DType::f32, kGPU).set_requires_grad(true);
    optim::AdamW adamw({p}, optim::AdamWOptions{1e-2, 0.9, 0.999, 1e-8, 0.0});
    adamw.set_capturable(capturable);
    p.set_grad(grad);
    adamw.step();
    return p.to_vector<double>();
  };
  const std::vector<double> on_device = first_update(true), on_host = first_update(false);
  for (size_t i = 0; i < on_host.size(); ++i) EXPECT_NEAR(on_device[i], on_host[i], 3e-7 * std::abs(on_host[i])) << i;
}

// A step the loss scaler skips on the device changes nothing, bit for bit:
// parameters, state and step counts (buffers it made stay as made: zeros);
// the next step is the one a run without the skipped step would take. The
// first step is skipped too, so the rule's first update comes after it.
// `tol`: how far a non-capturable run of the same updates may be (AdamW's
// bias corrections are rounded on the device there, on the host here).
void expect_device_skips_change_nothing(const MakeOptimizer& make, double tol) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  std::vector<Tensor> skipping, plain;
  for (const Shape& s : awkward_shapes()) {
    const Tensor p = randn(s, DType::f32, kCPU, &gen);
    skipping.push_back(prim::to(p, kGPU).set_requires_grad(true));
    plain.push_back(prim::to(p, kGPU).set_requires_grad(true));
  }
  std::unique_ptr<optim::Optimizer> a = make(skipping), b = make(plain);
  a->set_capturable(true);
  EXPECT_TRUE(a->skips_on_device());
  const Tensor no = zeros({1}, DType::f32, kGPU), yes = full({1}, 1.0, DType::f32, kGPU);
  auto set_grads = [&](bool also_plain) {
    for (size_t i = 0; i < skipping.size(); ++i) {
      const Tensor g = randn(skipping[i].shape(), DType::f32, kCPU, &gen);
      skipping[i].set_grad(prim::to(g, kGPU));
      if (also_plain) plain[i].set_grad(prim::to(g, kGPU));
    }
  };
  auto skip = [&] {
    const optim::StateDict before = a->state_dict();
    std::vector<std::vector<double>> params_before;
    for (const Tensor& p : skipping) params_before.push_back(host_f64(p));
    const int64_t count = a->step_count(0);
    set_grads(false);  // gradients the skipped step must not use
    a->step_skipping_if(yes);
    for (size_t i = 0; i < skipping.size(); ++i)
      EXPECT_EQ(host_f64(skipping[i]), params_before[i]) << "parameter " << i;
    for (const auto& [key, t] : a->state_dict()) {
      const std::vector<double> values = host_f64(t);
      if (before.contains(key)) EXPECT_EQ(values, host_f64(before.at(key))) << key;
      else EXPECT_EQ(values, std::vector<double>(values.size(), 0.0)) << key << " (made by the skipped step)";
    }
    EXPECT_EQ(a->step_count(0), count);
  };
  auto take = [&] {
    set_grads(true);
    a->step_skipping_if(no);
    b->step();
  };
  skip();
  EXPECT_EQ(a->step_count(0), 0);
  take();
  skip();
  take();
  // Measured absolutely: a parameter near zero makes a relative measure of
  // the same rounding large.
  for (size_t i = 0; i < skipping.size(); ++i)
    EXPECT_LE(testing::max_abs_diff(host_f64(skipping[i]), host_f64(plain[i])), tol) << "parameter " << i;
  EXPECT_EQ(a->step_count(0), 2);
  // Back to host counts: they carry the device's.
  a->set_capturable(false);
  EXPECT_EQ(a->state(0).step, 2);
}

// AdamW's fused CUDA step writing an FP8 layer's weight copies: the
// update bit for bit the multi-tensor kernel's, the copies those
// quantize_fp8 makes of the updated weight (codes, transpose, 1 / scale,
// the amax joined into the slot's), and the layer's copies marked as made
// from the weight; with host and device step counts, and in a step the
// loss scaler skips on the device (the weight unchanged, its copies made
// with the slot's scale all the same). Ragged tiles: 80 columns.
TEST(CudaOptim, AdamWWritesFp8WeightCopiesAsQuantizeWould) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  std::mt19937_64 rng(seed);
  const int64_t rows = 192, cols = 80;
  for (bool capturable : {false, true}) {
    SCOPED_TRACE(capturable ? "capturable" : "host steps");
    Generator gen(rng());
    const Tensor w0 = prim::to(randn({rows, cols}, DType::f32, kCPU, &gen), kGPU);
    Tensor w_fused = prim::contiguous(prim::mul_scalar(w0, 1.0)).set_requires_grad(true);
    Tensor w_plain = prim::contiguous(prim::mul_scalar(w0, 1.0)).set_requires_grad(true);
    const optim::AdamWOptions options{1e-2, 0.9, 0.99, 1e-8, 0.1};
    optim::AdamW fused({w_fused}, options), plain({w_plain}, options);
    fused.set_capturable(capturable);
    plain.set_capturable(capturable);

    auto scaling = std::make_shared<amp::Fp8Scaling>(amp::Fp8Recipe{}, kGPU);
    auto layer = std::make_shared<amp::Fp8LinearState>(amp::Fp8LinearState::for_layer(scaling, "w"));
    layer->weight_fp8 = Tensor::empty({rows, cols}, DType::e4m3, kGPU);
    layer->weight_fp8_t = Tensor::empty({cols, rows}, DType::e4m3, kGPU);
    layer->weight_scale_inv = Tensor::empty({1}, DType::f32, kGPU);
    ASSERT_TRUE(fused.write_fp8_copies(w_fused, layer));
    // Not for a weight whose sizes FP8 products cannot take.
    Tensor odd = prim::to(randn({rows, 20}), kGPU).set_requires_grad(true);
    optim::AdamW other({odd}, options);
    EXPECT_FALSE(other.write_fp8_copies(odd, layer));

    const Tensor amax_plain = prim::to(from_vector(std::vector<float>{0.0f}, {1}), kGPU);
    for (int step = 0; step < 3; ++step) {
      SCOPED_TRACE(step);
      // A scale for the weight's slot, and an amax to join (half the time
      // above the weight's).
      const float scale = std::ldexp(1.0f, static_cast<int>(rng() % 8)) * 1.37f;
      const float earlier_amax = rng() % 2 ? 1e3f : 1e-3f;
      prim::copy_(prim::slice(scaling->scale(Fp8Group::forward), 0, layer->weight_slot, layer->weight_slot + 1),
                  full({1}, scale, DType::f32, kGPU));
      prim::copy_(prim::slice(scaling->amax(Fp8Group::forward), 0, layer->weight_slot, layer->weight_slot + 1),
                  full({1}, earlier_amax, DType::f32, kGPU));
      prim::copy_(amax_plain, full({1}, earlier_amax, DType::f32, kGPU));
      const Tensor g = prim::to(randn({rows, cols}, DType::f32, kCPU, &gen), kGPU);
      w_fused.set_grad(prim::mul_scalar(g, 1.0));
      w_plain.set_grad(prim::mul_scalar(g, 1.0));
      const bool skipped = capturable && step == 1;
      const std::vector<uint8_t> before = bytes_of(w_fused);
      if (capturable) {
        const Tensor found_inf = full({1}, skipped ? 1.0 : 0.0, DType::f32, kGPU);
        fused.step_skipping_if(found_inf);
        plain.step_skipping_if(found_inf);
      } else {
        fused.step();
        plain.step();
      }
      EXPECT_EQ(bytes_of(w_fused), bytes_of(w_plain)) << "weight";
      for (const char* buffer : {"exp_avg", "exp_avg_sq"})
        EXPECT_EQ(bytes_of(fused.state(0).buffers.at(buffer)), bytes_of(plain.state(0).buffers.at(buffer))) << buffer;
      if (skipped) EXPECT_EQ(bytes_of(w_fused), before) << "a skipped step changes nothing";
      else EXPECT_NE(bytes_of(w_fused), before) << "the step updated the weight";
      const prim::Fp8Quantized q = prim::quantize_fp8(w_plain, DType::e4m3, full({1}, scale, DType::f32, kGPU),
                                                      amax_plain, true);
      EXPECT_EQ(bytes_of(layer->weight_fp8), bytes_of(q.data)) << "codes";
      EXPECT_EQ(bytes_of(layer->weight_fp8_t), bytes_of(q.data_t)) << "transposed codes";
      EXPECT_EQ(bytes_of(layer->weight_scale_inv), bytes_of(q.scale_inv)) << "1 / scale";
      EXPECT_EQ(bytes_of(prim::slice(scaling->amax(Fp8Group::forward), 0, layer->weight_slot, layer->weight_slot + 1)),
                bytes_of(amax_plain))
          << "amax";
      EXPECT_EQ(layer->weight_version, w_fused.version()) << "copies marked as made from this weight";
      EXPECT_EQ(layer->weight_storage.lock(), w_fused.storage());
    }
  }
}

TEST(CudaOptim, CapturableAdamWSkipsOnTheDevice) {
  MPT_SKIP_WITHOUT_CUDA();
  // The two runs differ only in where the bias corrections are rounded (the
  // device's f32 powers, the host's f64): far below a step of lr = 1e-2.
  expect_device_skips_change_nothing(
      [](std::vector<Tensor> p) {
        return std::make_unique<optim::AdamW>(std::move(p), optim::AdamWOptions{1e-2, 0.9, 0.99, 1e-8, 0.1});
      },
      1e-6);
}

TEST(CudaOptim, CapturableSgdSkipsOnTheDevice) {
  MPT_SKIP_WITHOUT_CUDA();
  // Dampening makes the first update (buffer = direction) differ from a
  // later one from a zero buffer (buffer = 0.9 * direction): a skipped first
  // step must leave the next update first. The same kernel runs both, with
  // the same rate: equal bits.
  expect_device_skips_change_nothing(
      [](std::vector<Tensor> p) {
        return std::make_unique<optim::SGD>(
            std::move(p), optim::SGDOptions{.lr = 0.05, .momentum = 0.9, .dampening = 0.1, .weight_decay = 1e-3});
      },
      0.0);
}

TEST(CudaOptim, CapturableSgdMatchesTheCpu) {
  MPT_SKIP_WITHOUT_CUDA();
  // Rate and weight decay read on the device, the first update found from
  // the device's count.
  for (bool nesterov : {false, true}) {
    SCOPED_TRACE(nesterov ? "nesterov" : "momentum");
    const MakeOptimizer make = [nesterov](std::vector<Tensor> p) {
      const bool on_gpu = p.front().device().is_cuda();  // the CPU side is the raw-op reference
      auto opt = std::make_unique<optim::SGD>(std::move(p),
                                              optim::SGDOptions{0.05, 0.9, nesterov ? 0.0 : 0.1, 1e-3, nesterov});
      if (on_gpu) opt->set_capturable(true);
      return opt;
    };
    expect_gpu_matches_cpu(make, DType::f32, true, 1e-5);
  }
}

TEST(CudaOptim, FusedSgdMatchesTheCpu) {
  MPT_SKIP_WITHOUT_CUDA();
  for (bool nesterov : {false, true}) {
    SCOPED_TRACE(nesterov ? "nesterov" : "momentum");
    const MakeOptimizer make = [nesterov](std::vector<Tensor> p) {
      return std::make_unique<optim::SGD>(
          std::move(p), optim::SGDOptions{0.05, 0.9, nesterov ? 0.0 : 0.1, 1e-3, nesterov});
    };
    expect_gpu_matches_cpu(make, DType::f32, true, 1e-5);
  }
  const MakeOptimizer plain = [](std::vector<Tensor> p) {
    return std::make_unique<optim::SGD>(std::move(p), optim::SGDOptions{0.05});
  };
  expect_gpu_matches_cpu(plain, DType::f32, true, 1e-6);
}

}  // namespace
}  // namespace mpt
