// The reference models (MLP, CNN, GPT-mini): parameter names and shapes as
// PyTorch's modules give them, parameter counts against the figures worked
// out from the layer formulas, and training that really lowers the loss.
#include <gtest/gtest.h>

#include "models/adamw.h"
#include "models/cnn.h"
#include "models/gpt.h"
#include "models/mlp.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

// PyTorch's Linear(in, out): weight in*out, bias out.
int64_t linear_params(int64_t in, int64_t out, bool bias = true) { return in * out + (bias ? out : 0); }

Tensor random_labels(int64_t n, int64_t classes, Generator& gen) {
  std::vector<int64_t> y;
  for (double u : rand({n}, DType::f32, kCPU, &gen, 0.0, static_cast<double>(classes)).to_vector<double>())
    y.push_back(std::min<int64_t>(static_cast<int64_t>(u), classes - 1));
  return from_vector(y, {n}, DType::i64);
}

// A few AdamW steps on one fixed batch must lower the loss (memorising it).
template <typename Forward>
void expect_loss_drops(nn::Module& model, Forward&& loss_of, int steps, double lr) {
  optim::AdamW opt(model.parameters(), {.lr = lr, .weight_decay = 0.0});
  double first = 0, last = 0;
  for (int i = 0; i < steps; ++i) {
    opt.zero_grad();
    Tensor loss = loss_of();
    if (i == 0) first = loss.item();
    last = loss.item();
    backward(loss);
    opt.step();
  }
  EXPECT_LT(last, 0.7 * first) << "loss " << first << " -> " << last;
}

TEST(ReferenceModels, MlpMatchesTheReferenceLayout) {
  Generator gen(1);
  auto mlp = nn::make_mlp({}, &gen);
  const auto named = mlp->named_parameters();
  EXPECT_EQ(named.keys(), (std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}));
  EXPECT_EQ(named.at("0.weight").shape(), (Shape{1024, 784}));
  EXPECT_EQ(named.at("2.weight").shape(), (Shape{1024, 1024}));
  EXPECT_EQ(named.at("4.weight").shape(), (Shape{10, 1024}));
  EXPECT_EQ(mlp->parameter_count(), linear_params(784, 1024) + linear_params(1024, 1024) + linear_params(1024, 10));
  EXPECT_EQ(mlp->parameter_count(), 1863690);  // as torch reports for the reference Sequential

  const Tensor x = randn({3, 784}, DType::f32, kCPU, &gen);
  EXPECT_EQ(mlp->forward(x).shape(), (Shape{3, 10}));
}

TEST(ReferenceModels, CnnMatchesTheReferenceLayout) {
  Generator gen(2);
  auto cnn = nn::make_cnn({}, &gen);
  const auto named = cnn->named_parameters();
  EXPECT_EQ(named.keys(), (std::vector<std::string>{"0.weight", "0.bias", "3.weight", "3.bias", "7.weight", "7.bias",
                                                    "9.weight", "9.bias"}));
  EXPECT_EQ(named.at("0.weight").shape(), (Shape{32, 1, 3, 3}));
  EXPECT_EQ(named.at("3.weight").shape(), (Shape{64, 32, 3, 3}));
  EXPECT_EQ(named.at("7.weight").shape(), (Shape{256, 3136}));
  EXPECT_EQ(named.at("9.weight").shape(), (Shape{10, 256}));
  const int64_t conv1 = 32 * 1 * 3 * 3 + 32, conv2 = 64 * 32 * 3 * 3 + 64;
  EXPECT_EQ(cnn->parameter_count(), conv1 + conv2 + linear_params(64 * 7 * 7, 256) + linear_params(256, 10));

  const Tensor x = randn({2, 1, 28, 28}, DType::f32, kCPU, &gen);
  EXPECT_EQ(cnn->forward(x).shape(), (Shape{2, 10}));
  EXPECT_THROW(nn::make_cnn({.image_size = 30}), ValueError);
}

// With batch_norm, PyTorch's Conv2d(bias=False), BatchNorm2d, ReLU,
// MaxPool2d for each convolution: the names and buffers of such a
// Sequential, so its state dict loads on either side.
TEST(ReferenceModels, CnnWithBatchNormHasTheNamesOfPyTorchsSequential) {
  Generator gen(2);
  auto cnn = nn::make_cnn({.batch_norm = true}, &gen);
  EXPECT_EQ(cnn->named_parameters().keys(),
            (std::vector<std::string>{"0.weight", "1.weight", "1.bias", "4.weight", "5.weight", "5.bias", "9.weight",
                                      "9.bias", "11.weight", "11.bias"}));
  EXPECT_EQ(cnn->named_buffers().keys(),
            (std::vector<std::string>{"1.running_mean", "1.running_var", "1.num_batches_tracked", "5.running_mean",
                                      "5.running_var", "5.num_batches_tracked"}));
  const int64_t conv1 = 32 * 1 * 3 * 3 + 2 * 32, conv2 = 64 * 32 * 3 * 3 + 2 * 64;
  EXPECT_EQ(cnn->parameter_count(), conv1 + conv2 + linear_params(64 * 7 * 7, 256) + linear_params(256, 10));
  const Tensor x = randn({2, 1, 28, 28}, DType::f32, kCPU, &gen);
  EXPECT_EQ(cnn->forward(x).shape(), (Shape{2, 10}));
  EXPECT_EQ(cnn->named_buffers().at("1.num_batches_tracked").item(), 1);
}

TEST(ReferenceModels, GptMatchesTheReferenceLayout) {
  Generator gen(3);
  nn::GPT gpt({}, &gen);
  const auto named = gpt.named_parameters();
  std::vector<std::string> expected = {"tok.weight", "pos.weight"};
  for (int b = 0; b < 6; ++b)
    for (const char* p : {"ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "qkv.weight", "qkv.bias", "proj.weight",
                          "proj.bias", "fc.weight", "fc.bias", "out.weight", "out.bias"})
      expected.push_back(fmt::format("blocks.{}.{}", b, p));
  expected.insert(expected.end(), {"ln.weight", "ln.bias", "head.weight"});
  EXPECT_EQ(named.keys(), expected);
  EXPECT_EQ(named.at("tok.weight").shape(), (Shape{65, 384}));
  EXPECT_EQ(named.at("pos.weight").shape(), (Shape{256, 384}));
  EXPECT_EQ(named.at("blocks.5.qkv.weight").shape(), (Shape{1152, 384}));
  EXPECT_EQ(named.at("blocks.5.fc.weight").shape(), (Shape{1536, 384}));
  EXPECT_EQ(named.at("blocks.5.out.weight").shape(), (Shape{384, 1536}));
  EXPECT_EQ(named.at("head.weight").shape(), (Shape{65, 384}));

  const int64_t d = 384, layer_norm = 2 * d;
  const int64_t block = 2 * layer_norm + linear_params(d, 3 * d) + linear_params(d, d) + linear_params(d, 4 * d) +
                        linear_params(4 * d, d);
  const int64_t total = 65 * d + 256 * d + 6 * block + layer_norm + linear_params(d, 65, false);
  EXPECT_EQ(gpt.parameter_count(), total);
  EXPECT_EQ(gpt.parameter_count(), 10795776);

  // Forward and backward at full size on a short sequence.
  const Tensor idx = from_vector(random_labels(8, 65, gen).to_vector<int64_t>(), {2, 4}, DType::i64);
  const Tensor logits = gpt.forward(idx);
  EXPECT_EQ(logits.shape(), (Shape{2, 4, 65}));
  backward(mean(logits));
  for (const auto& [name, p] : named) EXPECT_TRUE(p.grad().defined()) << name;
}

// MFU's numerator: 6 FLOPs per weight of every matrix product a token goes
// through (the two-dimensional weights but the embedding tables, which are
// looked up), plus attention's two products, 12 * layers * d * T, counted
// from the model's own parameters.
TEST(ReferenceModels, GptTrainingFlopsCountEveryMatrixProduct) {
  Generator gen(5);
  const nn::GPTOptions options{.vocab_size = 97, .context = 48, .d_model = 64, .n_layers = 3, .n_heads = 4};
  nn::GPT gpt(options, &gen);
  double matmul_weights = 0;
  for (const auto& [name, p] : gpt.named_parameters())
    if (p.dim() == 2 && name != "tok.weight" && name != "pos.weight") matmul_weights += static_cast<double>(p.numel());
  for (int64_t T : {1, 32, 48})
    EXPECT_EQ(gpt.training_flops_per_token(T), 6 * matmul_weights + 12.0 * 3 * 64 * static_cast<double>(T)) << T;
}

// GPT-2 small's sizes, the vocabulary padded to a multiple of 128 (163M
// parameters with the untied head, PyTorch's count of torch_bench.py's
// gpt2_124m).
TEST(ReferenceModels, Gpt2SmallOptionsAreGpt2Small) {
  const nn::GPTOptions o = nn::gpt2_small_options();
  EXPECT_EQ(o.vocab_size, 50304);
  EXPECT_EQ(o.vocab_size % 128, 0);
  EXPECT_EQ(o.context, 1024);
  EXPECT_EQ(o.d_model, 768);
  EXPECT_EQ(o.n_layers, 12);
  EXPECT_EQ(o.n_heads, 12);
  const int64_t d = o.d_model, layer_norm = 2 * d;
  const int64_t block = 2 * layer_norm + linear_params(d, 3 * d) + linear_params(d, d) + linear_params(d, 4 * d) +
                        linear_params(4 * d, d);
  EXPECT_EQ(o.vocab_size * d + o.context * d + o.n_layers * block + layer_norm + linear_params(d, o.vocab_size, false),
            163109376);
}

TEST(ReferenceModels, GptRejectsSequencesLongerThanItsContext) {
  nn::GPT gpt({.vocab_size = 5, .context = 4, .d_model = 8, .n_layers = 1, .n_heads = 2});
  const Tensor idx = zeros({1, 5}, DType::i64);
  try {
    gpt.forward(idx);
    FAIL() << "no error";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("context 4"), std::string::npos) << e.what();
  }
}

TEST(ReferenceModels, CausalityFutureTokensDoNotChangeEarlierLogits) {
  Generator gen(4);
  nn::GPT gpt({.vocab_size = 7, .context = 6, .d_model = 8, .n_layers = 2, .n_heads = 2}, &gen);
  NoGradGuard no_grad;
  const Tensor a = from_vector(std::vector<int64_t>{1, 2, 3, 4, 5, 6}, {1, 6}, DType::i64);
  const Tensor b = from_vector(std::vector<int64_t>{1, 2, 3, 0, 0, 0}, {1, 6}, DType::i64);
  const auto la = prim::slice(gpt.forward(a), 1, 0, 3).to_vector<float>();
  const auto lb = prim::slice(gpt.forward(b), 1, 0, 3).to_vector<float>();
  EXPECT_EQ(la, lb);
}

TEST(ReferenceModels, FewStepsLowerTheLoss) {
  Generator gen(5);
  {
    auto mlp = nn::make_mlp({.in_features = 20, .hidden = {32}, .num_classes = 4}, &gen);
    const Tensor x = randn({16, 20}, DType::f32, kCPU, &gen), y = random_labels(16, 4, gen);
    expect_loss_drops(*mlp, [&] { return cross_entropy(mlp->forward(x), y); }, 30, 1e-2);
  }
  {
    auto cnn = nn::make_cnn({.image_size = 8, .channels1 = 4, .channels2 = 8, .hidden = 16, .num_classes = 3}, &gen);
    const Tensor x = randn({8, 1, 8, 8}, DType::f32, kCPU, &gen), y = random_labels(8, 3, gen);
    expect_loss_drops(*cnn, [&] { return cross_entropy(cnn->forward(x), y); }, 30, 1e-2);
  }
  {
    nn::GPT gpt({.vocab_size = 11, .context = 8, .d_model = 16, .n_layers = 2, .n_heads = 2}, &gen);
    const Tensor idx = from_vector(random_labels(16, 11, gen).to_vector<int64_t>(), {2, 8}, DType::i64);
    const Tensor target = random_labels(16, 11, gen);
    expect_loss_drops(gpt, [&] { return cross_entropy(reshape(gpt.forward(idx), {16, 11}), target); }, 30, 1e-2);
  }
}

}  // namespace
}  // namespace mpt
