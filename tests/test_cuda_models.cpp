// The reference models on the GPU against the same weights on the CPU
// (outputs and parameter gradients, f32 tolerance; weights drawn again
// where a ReLU or a pooling window sits within rounding of its switch),
// and a checkpoint written from GPU tensors and restored onto the GPU.
// Skipped without a CUDA device.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "amp/autocast.h"
#include "autograd/grad_mode.h"
#include "models/adamw.h"
#include "models/batch_norm.h"
#include "models/checkpoint.h"
#include "models/cnn.h"
#include "models/generate.h"
#include "models/gpt.h"
#include "models/layers.h"
#include "models/mlp.h"
#include "models/sequential.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

using testing::host_f64;
using testing::rel_error;

double rms(const std::vector<float>& v) {
  double sum = 0;
  for (float x : v) sum += double(x) * x;
  return std::sqrt(sum / static_cast<double>(v.size()));
}

// Whether a ReLU's input lies within `margin` (of the values' rms) of zero,
// or a pooling window's two largest values within it of each other, in the
// CPU forward of a Sequential model. There the derivative is a coin flip
// between two devices that round differently (their f32 results differ by
// about 1e-7 of the scale), and the gradients of every layer before it then
// differ by a whole term: about 2% of the CNN's draws did.
bool derivative_is_a_coin_flip(nn::Module& model, const Tensor& input, double margin) {
  auto* sequential = dynamic_cast<nn::Sequential*>(&model);
  if (sequential == nullptr) return false;  // GPT: GELU, smooth, and no pooling
  NoGradGuard no_grad;
  Tensor h = input;
  for (const auto& [name, child] : sequential->named_children()) {
    const std::vector<float> v = h.to_vector<float>();
    const double eps = margin * rms(v);
    if (child->type_name() == "ReLU")
      for (float z : v)
        if (std::fabs(z) < eps) return true;
    if (child->type_name() == "MaxPool2d") {
      const Pool2dParams& g = static_cast<nn::MaxPool2d&>(*child).geometry;
      const Shape& s = h.shape();
      const int64_t ho = (s[2] - g.kernel_h) / g.stride_h + 1, wo = (s[3] - g.kernel_w) / g.stride_w + 1;
      for (int64_t plane = 0; plane < s[0] * s[1]; ++plane)
        for (int64_t oy = 0; oy < ho; ++oy)
          for (int64_t ox = 0; ox < wo; ++ox) {
            float top = -INFINITY, second = -INFINITY;
            for (int64_t ky = 0; ky < g.kernel_h; ++ky)
              for (int64_t kx = 0; kx < g.kernel_w; ++kx) {
                const float x = v[static_cast<size_t>((plane * s[2] + oy * g.stride_h + ky) * s[3] + ox * g.stride_w + kx)];
                second = std::max(second, std::min(top, x));
                top = std::max(top, x);
              }
            if (top > eps && top - second < eps) return true;
          }
    }
    h = child->forward(h);
  }
  return false;
}

// Builds the model twice from one seed, moves one copy to the GPU, runs
// the same input and loss through both and compares. Seeds whose
// derivatives are coin flips between the devices are drawn again.
template <typename Make>
void expect_gpu_matches_cpu(Make&& make, const Tensor& input, const Tensor& target, double tol) {
  uint64_t seed = 0;
  std::shared_ptr<nn::Module> cpu;
  for (int draw = 0;; ++draw) {
    ASSERT_LT(draw, 100) << "every draw had a ReLU input or a pooling tie within rounding";
    seed = testing::fresh_seed();
    Generator g(seed);
    cpu = make(g);
    if (!derivative_is_a_coin_flip(*cpu, input, 1e-6)) break;
  }
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator g2(seed);
  std::shared_ptr<nn::Module> gpu = make(g2);
  gpu->to(Device("cuda:0"));
  auto loss_of = [&](nn::Module& m, const Device& d) {
    Tensor out = m.forward(prim::to(input, d));
    if (out.dim() == 3) out = reshape(out, {-1, out.size(2)});
    return cross_entropy(out, prim::to(target, d));
  };
  const Tensor lc = loss_of(*cpu, kCPU), lg = loss_of(*gpu, Device("cuda:0"));
  EXPECT_NEAR(lg.item(), lc.item(), tol * std::max(1.0, std::fabs(lc.item())));
  backward(lc);
  backward(lg);
  const auto pc = cpu->named_parameters(), pg = gpu->named_parameters();
  for (size_t i = 0; i < pc.size(); ++i) {
    ASSERT_EQ(pg[i].second.device(), Device("cuda:0"));
    EXPECT_LE(rel_error(host_f64(pg[i].second.grad()), host_f64(pc[i].second.grad())), tol) << pc[i].first;
  }
}

Tensor labels(int64_t n, int64_t classes, Generator& gen) {
  std::vector<int64_t> y;
  for (double u : rand({n}, DType::f32, kCPU, &gen, 0.0, static_cast<double>(classes)).to_vector<double>())
    y.push_back(std::min<int64_t>(static_cast<int64_t>(u), classes - 1));
  return from_vector(y, {n}, DType::i64);
}

TEST(CudaModels, MlpMatchesTheCpu) {
  MPT_SKIP_WITHOUT_CUDA();
  Generator gen(1);
  expect_gpu_matches_cpu([](Generator& g) { return nn::make_mlp({}, &g); }, randn({16, 784}, DType::f32, kCPU, &gen),
                         labels(16, 10, gen), 1e-4);
}

TEST(CudaModels, CnnMatchesTheCpu) {
  MPT_SKIP_WITHOUT_CUDA();
  Generator gen(2);
  expect_gpu_matches_cpu([](Generator& g) { return nn::make_cnn({}, &g); },
                         randn({4, 1, 28, 28}, DType::f32, kCPU, &gen), labels(4, 10, gen), 1e-4);
}

TEST(CudaModels, CnnWithBatchNormMatchesTheCpu) {
  MPT_SKIP_WITHOUT_CUDA();
  Generator gen(4);
  expect_gpu_matches_cpu([](Generator& g) { return nn::make_cnn({.batch_norm = true}, &g); },
                         randn({8, 1, 28, 28}, DType::f32, kCPU, &gen), labels(8, 10, gen), 1e-4);
}

TEST(CudaModels, GptMatchesTheCpu) {
  MPT_SKIP_WITHOUT_CUDA();
  Generator gen(3);
  const Tensor idx = reshape(labels(2 * 32, 65, gen), {2, 32});
  expect_gpu_matches_cpu([](Generator& g) { return std::make_shared<nn::GPT>(nn::GPTOptions{}, &g); }, idx,
                         labels(2 * 32, 65, gen), 1e-4);
}

// Text sampled from a GPT on the GPU is the CPU's, token for token, for the
// same weights and seed: the draws are made on the host from the last
// position's logits, which the two devices compute equal up to rounding (a
// draw that falls within rounding of a boundary between two tokens has a
// chance near 1e-6 a token). Greedy picks are left out: an untrained
// model's logits lie close enough for rounding to swap the top two.
TEST(CudaModels, GptSamplesTheCpusTextOnTheGpu) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const nn::GPTOptions o{.vocab_size = 11, .context = 16, .d_model = 64, .n_layers = 2, .n_heads = 4};
  Generator init_cpu(seed), init_gpu(seed);
  nn::GPT cpu(o, &init_cpu), gpu(o, &init_gpu);
  gpu.to(Device("cuda:0"));
  // From one token (a window of one, whose attention weights are a single
  // 1) and from three, on past the context of 16.
  for (const std::vector<int64_t>& prompt : {std::vector<int64_t>{7}, std::vector<int64_t>{1, 2, 3}})
    for (const nn::SamplingOptions s : {nn::SamplingOptions{1, 0}, nn::SamplingOptions{0.7, 4}}) {
      Generator a(seed), b(seed);
      const std::vector<int64_t> on_cpu = nn::generate(cpu, prompt, 40, s, a);
      EXPECT_EQ(nn::generate(gpu, prompt, 40, s, b), on_cpu);
    }
}

// Under fp16 and bf16 autocast the cached keys and values are 16-bit, as
// the projection writes them; the cached reads give the logits of whole
// reads up to 16-bit rounding.
TEST(CudaModels, GptCachedReadsUnderAutocastGiveTheLogitsOfWholeReads) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator init(seed);
  nn::GPT model({.vocab_size = 13, .context = 32, .d_model = 64, .n_layers = 2, .n_heads = 4}, &init);
  model.to(Device("cuda:0"));
  std::vector<int64_t> tokens;
  for (double u : rand({32}, DType::f32, kCPU, &init, 0.0, 13.0).to_vector<double>())
    tokens.push_back(std::min<int64_t>(static_cast<int64_t>(u), 12));
  for (const DType low : {DType::f16, DType::bf16}) {
    SCOPED_TRACE(dtype_name(low));
    amp::AutocastGuard autocast(DeviceType::cuda, low);
    NoGradGuard no_grad;
    nn::GPTCache cache;
    for (const auto& [from, to] : std::vector<std::pair<int64_t, int64_t>>{{0, 5}, {5, 6}, {6, 7}, {7, 32}}) {
      const Tensor cached = model.forward_cached(
          from_vector(std::vector<int64_t>(tokens.begin() + from, tokens.begin() + to), {1, to - from}, DType::i64,
                      Device("cuda:0")),
          cache);
      EXPECT_EQ(cache.keys[0].dtype(), low);
      const Tensor whole = model.forward(
          from_vector(std::vector<int64_t>(tokens.begin(), tokens.begin() + to), {1, to}, DType::i64, Device("cuda:0")));
      EXPECT_LE(rel_error(host_f64(cached), host_f64(prim::slice(whole, 1, to - 1, to))), low == DType::f16 ? 1e-2 : 5e-2)
          << "positions " << from << " to " << to - 1;
    }
  }
}

TEST(CudaModels, CheckpointOfGpuTensorsRestoresOntoTheGpu) {
  MPT_SKIP_WITHOUT_CUDA();
  const std::string path =
      (std::filesystem::temp_directory_path() / fmt::format("mpt-cuda-ckpt-{}.safetensors", getpid())).string();
  Generator gen(2);
  auto a = nn::make_mlp({.in_features = 8, .hidden = {16}, .num_classes = 3}, &gen);
  a->to(Device("cuda:0"));
  optim::AdamW opt_a(a->parameters());
  backward(sum(a->forward(randn({4, 8}, DType::f32, Device("cuda:0"), &gen))));
  opt_a.step();
  ckpt::save_checkpoint(path, ckpt::capture(*a, opt_a, 1, {}, gen));

  Generator other(3);
  auto b = nn::make_mlp({.in_features = 8, .hidden = {16}, .num_classes = 3}, &other);
  b->to(Device("cuda:0"));
  optim::AdamW opt_b(b->parameters());
  ckpt::restore(ckpt::read_checkpoint(path), *b, opt_b, other);
  std::filesystem::remove(path);
  const auto sa = a->state_dict(), sb = b->state_dict();
  for (size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sb[i].second.device(), Device("cuda:0"));
    EXPECT_EQ(sb[i].second.to_vector<float>(), sa[i].second.to_vector<float>()) << sa[i].first;
  }
  EXPECT_EQ(opt_b.state(0).buffers.at("exp_avg").device(), Device("cuda:0"));
  // The optimizer's state too: every moment and step count, on the GPU.
  const auto oa = opt_a.state_dict(), ob = opt_b.state_dict();
  ASSERT_EQ(ob.size(), oa.size());
  for (size_t i = 0; i < oa.size(); ++i) {
    EXPECT_EQ(ob[i].first, oa[i].first);
    EXPECT_EQ(host_f64(ob[i].second), host_f64(oa[i].second)) << oa[i].first;
  }
  EXPECT_EQ(opt_b.state(0).step, 1);
}

// A BatchNorm2d moved to the GPU (its i64 batch count too) keeps the
// running statistics the CPU keeps over three training batches, counts
// them, normalises by them in eval mode, and gives a 16-bit output for a
// 16-bit input under autocast.
TEST(CudaModels, BatchNormKeepsTheCpusRunningStatistics) {
  MPT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  const Device gpu("cuda:0");
  nn::BatchNorm2d cpu_bn(5), gpu_bn(5);
  gpu_bn.to(gpu);
  ASSERT_EQ(gpu_bn.num_batches_tracked.device(), gpu);
  for (int step = 0; step < 3; ++step) {
    const Tensor x = randn({6, 5, 7, 7}, DType::f32, kCPU, &gen);
    const Tensor yc = cpu_bn.forward(x), yg = gpu_bn.forward(prim::to(x, gpu));
    EXPECT_LE(rel_error(host_f64(yg), host_f64(yc)), 1e-5) << "step " << step;
  }
  EXPECT_EQ(gpu_bn.num_batches_tracked.item(), 3);
  EXPECT_LE(rel_error(host_f64(gpu_bn.running_mean), host_f64(cpu_bn.running_mean)), 1e-5);
  EXPECT_LE(rel_error(host_f64(gpu_bn.running_var), host_f64(cpu_bn.running_var)), 1e-5);
  cpu_bn.eval();
  gpu_bn.eval();
  const Tensor x = randn({2, 5, 4, 4}, DType::f32, kCPU, &gen);
  EXPECT_LE(rel_error(host_f64(gpu_bn.forward(prim::to(x, gpu))), host_f64(cpu_bn.forward(x))), 1e-5);
  amp::AutocastGuard autocast(DeviceType::cuda);
  EXPECT_EQ(gpu_bn.forward(prim::to(prim::to(x, DType::f16), gpu)).dtype(), DType::f16);
}

}  // namespace
}  // namespace mpt
