// The reference models on the GPU against the same weights on the CPU
// (outputs and parameter gradients, f32 tolerance), and a checkpoint written
// from GPU tensors and restored onto the GPU. Skipped without a CUDA device.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "models/adamw.h"
#include "models/checkpoint.h"
#include "models/cnn.h"
#include "models/gpt.h"
#include "models/mlp.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

using testing::host_f64;
using testing::rel_error;

// Builds the model twice from one seed, moves one copy to the GPU, runs
// the same input and loss through both and compares.
template <typename Make>
void expect_gpu_matches_cpu(Make&& make, const Tensor& input, const Tensor& target, double tol) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator g1(seed), g2(seed);
  std::shared_ptr<nn::Module> cpu = make(g1), gpu = make(g2);
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

TEST(CudaModels, ReferenceModelsMatchTheCpu) {
  MPT_SKIP_WITHOUT_CUDA();
  Generator gen(1);
  expect_gpu_matches_cpu([](Generator& g) { return nn::make_mlp({}, &g); }, randn({16, 784}, DType::f32, kCPU, &gen),
                         labels(16, 10, gen), 1e-4);
  expect_gpu_matches_cpu([](Generator& g) { return nn::make_cnn({}, &g); },
                         randn({4, 1, 28, 28}, DType::f32, kCPU, &gen), labels(4, 10, gen), 1e-4);
  const Tensor idx = reshape(labels(2 * 32, 65, gen), {2, 32});
  expect_gpu_matches_cpu([](Generator& g) { return std::make_shared<nn::GPT>(nn::GPTOptions{}, &g); }, idx,
                         labels(2 * 32, 65, gen), 1e-4);
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
}

}  // namespace
}  // namespace mpt
