// The fused multi-tensor optimizer kernels on the GPU against the raw-op
// rules on the CPU: the same parameters and gradients, several steps, many
// tensors of awkward sizes (so launches split across tensor lists and
// chunks), per dtype tolerance; and, bit for bit, against the CPU's fused
// loops.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>

#include "models/adamw.h"
#include "models/sgd.h"
#include "tests/optimizer_check.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

using testing::awkward_shapes;
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
