// Modules and layers: naming and ordering, state dicts, placement, PyTorch
// initialisation, layer outputs against f64 references, and a small MLP
// that really learns, bit-identically run to run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "amp/autocast.h"
#include "autograd/engine.h"
#include "autograd/node.h"
#include "models/adamw.h"
#include "models/attention.h"
#include "models/gpt.h"
#include "models/layers.h"
#include "models/sequential.h"
#include "models/sgd.h"
#include "models/training_mode.h"
#include "tests/layer_norm_ref.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

using testing::error_of;
using testing::expect_contains;
using testing::host_f64;
using testing::rel_error;
using Vec = std::vector<double>;

class ModelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = testing::fresh_seed();
    gen_.manual_seed(seed_);
  }
  std::string trace() const { return fmt::format("seed {}", seed_); }
  uint64_t seed_ = 0;
  Generator gen_;
};

// Bit-exact host copies of every parameter, by name.
std::vector<std::pair<std::string, std::vector<float>>> snapshot(const nn::Module& m) {
  std::vector<std::pair<std::string, std::vector<float>>> out;
  for (const auto& [name, t] : m.state_dict()) out.emplace_back(name, t.to_vector<float>());
  return out;
}

// A GPT-style block and net, shaped like the reference's GPTBlock/GPTMini.
struct Block : nn::Module {
  explicit Block(int64_t d, int64_t h, Generator* gen) : Module("Block") {
    ln1 = register_module("ln1", std::make_shared<nn::LayerNorm>(d));
    attn = register_module("attn", std::make_shared<nn::CausalSelfAttention>(d, h, gen));
    ln2 = register_module("ln2", std::make_shared<nn::LayerNorm>(d));
    fc = register_module("fc", std::make_shared<nn::Linear>(d, 4 * d, true, gen));
    out = register_module("out", std::make_shared<nn::Linear>(4 * d, d, true, gen));
  }
  Tensor forward(const Tensor& x) override {
    Tensor y = x + attn->forward(ln1->forward(x));
    return y + out->forward(gelu(fc->forward(ln2->forward(y))));
  }
  std::shared_ptr<nn::LayerNorm> ln1, ln2;
  std::shared_ptr<nn::CausalSelfAttention> attn;
  std::shared_ptr<nn::Linear> fc, out;
};

struct TinyGpt : nn::Module {
  TinyGpt(int64_t vocab, int64_t ctx, int64_t d, int64_t layers, int64_t heads, Generator* gen) : Module("TinyGpt") {
    tok = register_module("tok", std::make_shared<nn::Embedding>(vocab, d, gen));
    pos = register_module("pos", std::make_shared<nn::Embedding>(ctx, d, gen));
    blocks = register_module("blocks", std::make_shared<nn::Sequential>());
    for (int64_t i = 0; i < layers; ++i) blocks->push_back(std::make_shared<Block>(d, heads, gen));
    ln = register_module("ln", std::make_shared<nn::LayerNorm>(d));
    head = register_module("head", std::make_shared<nn::Linear>(d, vocab, false, gen));
  }
  Tensor forward(const Tensor& idx) override {
    const int64_t T = idx.size(1);
    std::vector<int64_t> positions(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) positions[t] = t;
    const Tensor x = tok->forward(idx) + pos->forward(from_vector(positions, {T}, DType::i64));
    return head->forward(ln->forward(blocks->forward(x)));
  }
  std::shared_ptr<nn::Embedding> tok, pos;
  std::shared_ptr<nn::Sequential> blocks;
  std::shared_ptr<nn::LayerNorm> ln;
  std::shared_ptr<nn::Linear> head;
};

Tensor random_tokens(int64_t B, int64_t T, int64_t vocab, Generator& gen) {
  const Vec u = host_f64(rand({B, T}, DType::f32, kCPU, &gen, 0.0, static_cast<double>(vocab)));
  std::vector<int64_t> idx;
  for (double x : u) idx.push_back(std::min<int64_t>(static_cast<int64_t>(x), vocab - 1));
  return from_vector(idx, {B, T}, DType::i64);
}

// ---- naming and ordering ------------------------------------------------------------------------

TEST_F(ModelsTest, ParameterNamesAreDottedAndInRegistrationOrder) {
  TinyGpt net(11, 8, 8, 2, 2, &gen_);
  std::vector<std::string> expected = {"tok.weight", "pos.weight"};
  for (const char* b : {"blocks.0.", "blocks.1."}) {
    for (const char* p : {"ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
                          "attn.proj.bias", "ln2.weight", "ln2.bias", "fc.weight", "fc.bias", "out.weight",
                          "out.bias"})
      expected.push_back(std::string(b) + p);
  }
  expected.insert(expected.end(), {"ln.weight", "ln.bias", "head.weight"});

  const auto named = net.named_parameters();
  EXPECT_EQ(named.keys(), expected);
  EXPECT_EQ(net.state_dict().keys(), expected);  // no buffers here
  const std::vector<Tensor> params = net.parameters();
  ASSERT_EQ(params.size(), expected.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(params[i].is_same(named[i].second));
    EXPECT_TRUE(params[i].requires_grad()) << expected[i];
    EXPECT_EQ(params[i].dtype(), DType::f32) << expected[i];
    EXPECT_EQ(params[i].autograd_meta().name, expected[i]);  // stamped for messages and traces
  }
  EXPECT_EQ(named.at("blocks.1.attn.qkv.weight").shape(), (Shape{24, 8}));
  EXPECT_TRUE(named.at("blocks.1.fc.weight").is_same(
      std::static_pointer_cast<Block>((*net.blocks)[1])->fc->weight));

  std::vector<std::string> modules;
  for (const auto& [name, m] : net.named_modules()) modules.push_back(name + ":" + m->type_name());
  EXPECT_EQ(modules[0], ":TinyGpt");
  EXPECT_EQ(modules[3], "blocks:Sequential");
  EXPECT_EQ(modules[4], "blocks.0:Block");
  EXPECT_EQ(modules[6], "blocks.0.attn:CausalSelfAttention");
  EXPECT_EQ(modules[7], "blocks.0.attn.qkv:Linear");
}

struct Registrar : nn::Module {
  Registrar() : Module("Registrar") {}
  using Module::register_buffer;
  using Module::register_module;
  using Module::register_parameter;
};

TEST_F(ModelsTest, RegistrationRulesAndTiedWeights) {
  Registrar m;
  const Tensor w = m.register_parameter("w", randn({2, 3}, DType::f64, kCPU, &gen_));
  EXPECT_EQ(w.dtype(), DType::f32);  // master weights are f32
  EXPECT_TRUE(w.requires_grad());
  expect_contains(error_of<ValueError>([&] { m.register_parameter("w", zeros({1})); }), {"Registrar", "'w'", "taken"});
  expect_contains(error_of<ValueError>([&] { m.register_buffer("a.b", zeros({1})); }), {"'a.b'", "'.'"});
  expect_contains(error_of<DTypeError>([&] { m.register_parameter("i", zeros({1}, DType::i64)); }), {"'i'"});
  m.register_buffer("running", full({4}, 2.0));

  // One tensor under two names (tied embeddings): one parameter, two keys.
  auto child = m.register_module("child", std::make_shared<Registrar>());
  child->register_parameter("tied", w);
  const auto named = m.named_parameters();
  EXPECT_EQ(named.keys(), (std::vector<std::string>{"w"}));
  // In PyTorch's order: a module's own parameters and buffers, then its children's.
  EXPECT_EQ(m.state_dict().keys(), (std::vector<std::string>{"w", "running", "child.tied"}));
  EXPECT_EQ(m.named_buffers().keys(), (std::vector<std::string>{"running"}));
  // A buffer two modules share is one buffer too (broadcast and moved once).
  child->register_buffer("shared_running", m.named_buffers().at("running"));
  EXPECT_EQ(m.named_buffers().keys(), (std::vector<std::string>{"running"}));
  EXPECT_EQ(m.state_dict().keys(), (std::vector<std::string>{"w", "running", "child.tied", "child.shared_running"}));
}

// ---- state dicts ----------------------------------------------------------------------------------------

TEST_F(ModelsTest, StateDictRoundTripReproducesOutputs) {
  SCOPED_TRACE(trace());
  Generator other(seed_ + 1);
  TinyGpt a(13, 6, 8, 2, 2, &gen_), b(13, 6, 8, 2, 2, &other);
  const Tensor idx = random_tokens(2, 6, 13, gen_);
  NoGradGuard no_grad;
  const auto ya = a.forward(idx).to_vector<float>();
  ASSERT_NE(ya, b.forward(idx).to_vector<float>());

  const nn::LoadResult r = b.load_state_dict(a.state_dict());
  EXPECT_TRUE(r.missing_keys.empty());
  EXPECT_TRUE(r.unexpected_keys.empty());
  EXPECT_EQ(b.forward(idx).to_vector<float>(), ya);
  EXPECT_EQ(snapshot(b), snapshot(a));
  // Values were copied, not shared.
  EXPECT_FALSE(b.tok->weight.storage() == a.tok->weight.storage());
}

TEST_F(ModelsTest, BadStateDictNamesTheKeyAndLoadsNothing) {
  SCOPED_TRACE(trace());
  Generator other(seed_ + 1);
  nn::Sequential model{std::make_shared<nn::Linear>(4, 3, true, &gen_), std::make_shared<nn::ReLU>(),
                       std::make_shared<nn::Linear>(3, 2, true, &gen_)};
  nn::Sequential source{std::make_shared<nn::Linear>(4, 3, true, &other), std::make_shared<nn::ReLU>(),
                        std::make_shared<nn::Linear>(3, 2, true, &other)};
  const nn::StateDict good = source.state_dict();
  const auto before = snapshot(model);
  auto edited = [&](const std::string& skip, const std::string& add, const Tensor& value) {
    nn::StateDict d;
    for (const auto& [k, v] : good)
      if (k != skip) d.insert(k, v);
    if (!add.empty()) d.insert_or_assign(add, value);
    return d;
  };

  // Every bad dict still holds valid values for the other keys; none may land.
  std::string msg = error_of<ValueError>([&] { model.load_state_dict(edited("2.bias", "", {})); });
  expect_contains(msg, {"Sequential", "missing key '2.bias'", "f32[2]", "nothing was loaded"});
  EXPECT_EQ(snapshot(model), before);

  msg = error_of<ValueError>([&] { model.load_state_dict(edited("", "2.scale", ones({2}))); });
  expect_contains(msg, {"unexpected key '2.scale'", "f32[2]"});
  EXPECT_EQ(snapshot(model), before);

  msg = error_of<ShapeError>([&] { model.load_state_dict(edited("", "0.weight", zeros({4, 3}))); });
  expect_contains(msg, {"'0.weight'", "f32[4, 3]", "f32[3, 4]"});
  EXPECT_EQ(snapshot(model), before);

  msg = error_of<DTypeError>([&] { model.load_state_dict(edited("", "0.bias", zeros({3}, DType::f16))); });
  expect_contains(msg, {"'0.bias'", "f16[3]", "f32[3]"});
  EXPECT_EQ(snapshot(model), before);

  // All problems at once, each listed.
  nn::StateDict many = edited("0.bias", "2.weight", zeros({1}));
  many.insert("extra", zeros({1}));
  msg = error_of<ValueError>([&] { model.load_state_dict(many); });
  expect_contains(msg, {"3 problems", "'0.bias'", "'2.weight'", "'extra'"});
  EXPECT_EQ(snapshot(model), before);

  // Not strict: missing and unexpected keys are reported, the rest loads.
  nn::StateDict partial = edited("2.bias", "unused", zeros({5}));
  const nn::LoadResult r = model.load_state_dict(partial, /*strict=*/false);
  EXPECT_EQ(r.missing_keys, (std::vector<std::string>{"2.bias"}));
  EXPECT_EQ(r.unexpected_keys, (std::vector<std::string>{"unused"}));
  EXPECT_EQ(model.state_dict().at("0.weight").to_vector<float>(), good.at("0.weight").to_vector<float>());
  EXPECT_EQ(model.state_dict().at("2.bias").to_vector<float>(), before[3].second);
  // Shape mismatches are errors even when not strict.
  EXPECT_THROW(model.load_state_dict(edited("", "2.bias", zeros({7})), false), ShapeError);
}

// ---- mode, placement, gradients -------------------------------------------------------------------

TEST_F(ModelsTest, TrainEvalRecursesAndDropoutFollowsIt) {
  SCOPED_TRACE(trace());
  auto drop = std::make_shared<nn::Dropout>(0.5, &gen_);
  nn::Sequential model{std::make_shared<nn::Linear>(8, 8, true, &gen_), drop};
  const Tensor x = randn({16, 8}, DType::f32, kCPU, &gen_);
  EXPECT_TRUE(drop->is_training());
  model.eval();
  EXPECT_FALSE(model.is_training());
  EXPECT_FALSE(drop->is_training());
  const Tensor y = model.forward(x);
  EXPECT_EQ(y.to_vector<float>(), model[0]->forward(x).to_vector<float>());  // identity in eval
  model.train();
  EXPECT_TRUE(drop->is_training());
  const Vec yt = host_f64(model.forward(x)), ye = host_f64(y);
  int zeros_seen = 0;
  for (size_t i = 0; i < yt.size(); ++i) {
    if (yt[i] == 0) {
      ++zeros_seen;
    } else {
      EXPECT_NEAR(yt[i], 2 * ye[i], 1e-5 * (1 + std::fabs(ye[i])));  // kept values scaled by 1/(1-p)
    }
  }
  EXPECT_GT(zeros_seen, 20);
  EXPECT_LT(zeros_seen, 108);
  EXPECT_THROW(nn::Dropout(1.5), ValueError);

  // At p = 0.2 dropping with probability p and keeping with probability p
  // differ, and so do the scales 1 / (1 - p) and 1 / p: a fifth of the
  // elements (within 5 sigma) drop, the others are multiplied by 1.25.
  nn::Dropout fifth(0.2, &gen_);
  const int64_t n = 20000;
  const std::vector<float> out = fifth.forward(full({n}, 1.0)).to_vector<float>();
  const auto dropped = std::count(out.begin(), out.end(), 0.0f);
  const double sigma = std::sqrt(n * 0.2 * 0.8);
  EXPECT_NEAR(static_cast<double>(dropped), 0.2 * n, 5 * sigma);
  for (float v : out)
    if (v != 0.0f) ASSERT_EQ(v, 1.25f);

  // In bf16 the kept values are x / (1 - p) rounded once, not x times a
  // rounded 1 / (1 - p) (1.109375 for p = 0.1, 0.16% short): over many
  // values the kept sum grows by 1 / 0.9 to within 0.03%.
  nn::Dropout tenth(0.1, &gen_);
  const Tensor x16 = rand({n}, DType::bf16, kCPU, &gen_, 1.0, 2.0);
  const std::vector<double> in16 = host_f64(x16), out16 = host_f64(tenth.forward(x16));
  double kept_in = 0, kept_out = 0;
  for (size_t i = 0; i < in16.size(); ++i)
    if (out16[i] != 0) {
      kept_in += in16[i];
      kept_out += out16[i];
    }
  EXPECT_NEAR(kept_out / kept_in, 1 / 0.9, 3e-4 / 0.9);
  EXPECT_NEAR(static_cast<double>(std::count(out16.begin(), out16.end(), 0.0)), 0.1 * n, 5 * std::sqrt(n * 0.09));
}

// Modules in different modes (a dropout switched off inside a training
// model; a training part inside an evaluated one): an EvalModeGuard puts all
// in eval mode and gives each its own mode back, and copy_training_modes
// gives a twin tree the same modes. Module::train alone would make them one.
TEST_F(ModelsTest, TrainingModesComeBackModuleByModule) {
  SCOPED_TRACE(trace());
  auto make = [this] {
    auto root = std::make_shared<nn::Sequential>(), inner = std::make_shared<nn::Sequential>();
    inner->push_back(std::make_shared<nn::Dropout>(0.5, &gen_));
    root->push_back(std::make_shared<nn::Linear>(4, 4, true, &gen_));
    root->push_back(std::make_shared<nn::Dropout>(0.5, &gen_));
    root->push_back(inner);
    return root;
  };
  auto modes = [](nn::Module& m) {
    std::vector<bool> out;
    for (const auto& [name, module] : m.named_modules()) out.push_back(module->is_training());
    return out;
  };
  auto model = make();
  (*model)[1]->eval();  // root, linear, inner training; the outer dropout not
  const std::vector<bool> mixed = modes(*model);
  ASSERT_EQ(mixed, (std::vector<bool>{true, true, false, true, true}));
  {
    nn::EvalModeGuard eval_mode(*model);
    EXPECT_EQ(modes(*model), std::vector<bool>(5, false));
  }
  EXPECT_EQ(modes(*model), mixed);

  model->eval();
  (*model)[2]->train();  // an evaluated root around a training part
  const std::vector<bool> inverted = modes(*model);
  {
    nn::EvalModeGuard eval_mode(*model);
    EXPECT_EQ(modes(*model), std::vector<bool>(5, false));
  }
  EXPECT_EQ(modes(*model), inverted);

  auto twin = make();
  nn::copy_training_modes(*model, *twin);
  EXPECT_EQ(modes(*twin), inverted);
  (*model)[1]->train();
  nn::copy_training_modes(*model, *twin);
  EXPECT_EQ(modes(*twin), modes(*model));
}

TEST_F(ModelsTest, ToMovesParametersInPlace) {
  SCOPED_TRACE(trace());
  const Device dev("cpu:1");  // a virtual CPU device: a real move, no GPU needed
  auto lin = std::make_shared<nn::Linear>(3, 2, true, &gen_);
  nn::Sequential model{lin};
  const Tensor held = lin->weight;  // e.g. an optimizer's handle
  const auto values = snapshot(model);
  lin->bias.set_grad(ones({2}));
  model.to(dev);
  EXPECT_EQ(held.device(), dev);
  EXPECT_EQ(lin->weight.device(), dev);
  EXPECT_EQ(lin->bias.grad().device(), dev);
  EXPECT_TRUE(held.requires_grad());
  EXPECT_EQ(model.named_parameters().at("0.weight").autograd_meta().name, "0.weight");
  EXPECT_EQ(snapshot(model), values);
  const Tensor x = prim::to(randn({4, 3}, DType::f32, kCPU, &gen_), dev);
  EXPECT_EQ(model.forward(x).device(), dev);
  model.to(kCPU);
  EXPECT_EQ(held.device(), kCPU);
}

TEST_F(ModelsTest, ZeroGradDropsEveryGradient) {
  SCOPED_TRACE(trace());
  TinyGpt net(7, 4, 8, 1, 2, &gen_);
  const Tensor idx = random_tokens(2, 4, 7, gen_);
  backward(sum(net.forward(idx)));
  for (const auto& [name, p] : net.named_parameters()) {
    ASSERT_TRUE(p.grad().defined()) << name;
    EXPECT_EQ(p.grad().shape(), p.shape()) << name;
  }
  net.zero_grad();
  for (const auto& [name, p] : net.named_parameters()) EXPECT_FALSE(p.grad().defined()) << name;
}

// ---- initialisation ---------------------------------------------------------------------------------

struct Moments {
  double mean, std, max_abs;
};
Moments moments(const Tensor& t) {
  const Vec v = host_f64(t);
  double s = 0, ss = 0, m = 0;
  for (double x : v) s += x, m = std::max(m, std::fabs(x));
  const double mean = s / v.size();
  for (double x : v) ss += (x - mean) * (x - mean);
  return {mean, std::sqrt(ss / v.size()), m};
}

TEST_F(ModelsTest, InitialisationMatchesPyTorchDistributions) {
  SCOPED_TRACE(trace());
  {  // Linear: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias; std = bound/sqrt(3).
    nn::Linear lin(1000, 400, true, &gen_);
    const double bound = 1 / std::sqrt(1000.0);
    const Moments w = moments(lin.weight), b = moments(lin.bias);
    EXPECT_LE(w.max_abs, bound);
    EXPECT_GT(w.max_abs, 0.99 * bound);
    EXPECT_NEAR(w.std, bound / std::sqrt(3.0), 0.01 * bound / std::sqrt(3.0));
    EXPECT_NEAR(w.mean, 0, 5 * w.std / std::sqrt(400000.0));
    EXPECT_LE(b.max_abs, bound);
    EXPECT_NEAR(b.std, bound / std::sqrt(3.0), 0.15 * bound / std::sqrt(3.0));
  }
  {  // Conv2d: fan_in = in_channels * k * k.
    nn::Conv2d conv(6, 64, 5, 1, 0, true, &gen_);
    const double bound = 1 / std::sqrt(150.0);
    const Moments w = moments(conv.weight);
    EXPECT_EQ(conv.weight.shape(), (Shape{64, 6, 5, 5}));
    EXPECT_LE(w.max_abs, bound);
    EXPECT_NEAR(w.std, bound / std::sqrt(3.0), 0.03 * bound / std::sqrt(3.0));
    EXPECT_LE(moments(conv.bias).max_abs, bound);
  }
  {  // Embedding: N(0, 1).
    nn::Embedding emb(1000, 64, &gen_);
    const Moments w = moments(emb.weight);
    EXPECT_NEAR(w.std, 1.0, 0.02);
    EXPECT_NEAR(w.mean, 0.0, 5 / std::sqrt(64000.0));
  }
  {  // LayerNorm: weight 1, bias 0.
    nn::LayerNorm ln(5);
    EXPECT_EQ(host_f64(ln.weight), Vec(5, 1.0));
    EXPECT_EQ(host_f64(ln.bias), Vec(5, 0.0));
  }
  nn::Linear no_bias(3, 4, false, &gen_);
  EXPECT_FALSE(no_bias.bias.defined());
  EXPECT_EQ(no_bias.named_parameters().keys(), (std::vector<std::string>{"weight"}));
}

TEST_F(ModelsTest, SeededConstructionIsReproducible) {
  SCOPED_TRACE(trace());
  Generator g1(seed_), g2(seed_), g3(seed_ ^ 0x9e3779b97f4a7c15ull);
  TinyGpt a(9, 4, 8, 1, 2, &g1), b(9, 4, 8, 1, 2, &g2), c(9, 4, 8, 1, 2, &g3);
  EXPECT_EQ(snapshot(a), snapshot(b));
  EXPECT_NE(snapshot(a), snapshot(c));
  // The default generator, via manual_seed.
  manual_seed(seed_);
  nn::Linear d(5, 5);
  manual_seed(seed_);
  nn::Linear e(5, 5);
  EXPECT_EQ(snapshot(d), snapshot(e));
}

// ---- layer outputs against references --------------------------------------------------------------

// A Linear and the ReLU after it run as one linear_relu node, with what the
// two modules give one after the other; a Linear not followed by a ReLU,
// and a ReLU not after a Linear, run as they are.
TEST_F(ModelsTest, SequentialRunsALinearAndTheReluAfterItAsOneOp) {
  SCOPED_TRACE(trace());
  auto first = std::make_shared<nn::Linear>(5, 4, true, &gen_);
  auto last = std::make_shared<nn::Linear>(4, 3, true, &gen_);
  nn::Sequential model{first, std::make_shared<nn::ReLU>(), last, std::make_shared<nn::ReLU>(),
                       std::make_shared<nn::ReLU>()};
  const Tensor x = randn({6, 5}, DType::f32, kCPU, &gen_);
  const Tensor y = model.forward(x);
  const Tensor want = relu(relu(last->forward(relu(first->forward(x)))));
  EXPECT_EQ(host_f64(y), host_f64(want));
  // The graph: relu <- linear_relu (the second Linear and its ReLU) <- linear_relu.
  ASSERT_TRUE(y.grad_fn());
  EXPECT_EQ(y.grad_fn()->name(), "relu");
  const auto& fused = y.grad_fn()->next_edges()[0].node;
  ASSERT_TRUE(fused);
  EXPECT_EQ(fused->name(), "linear_relu");
  ASSERT_TRUE(fused->next_edges()[0].node);
  EXPECT_EQ(fused->next_edges()[0].node->name(), "linear_relu");
  // The same gradients as the modules one by one.
  backward(sum(y * y));
  const Vec fused_grads = host_f64(first->weight.grad());
  first->weight.set_grad(Tensor());
  backward(sum(want * want));
  EXPECT_LT(rel_error(host_f64(first->weight.grad()), fused_grads), 1e-6);
}

// Under autocast the GPT's norms write the dtype of the linear layer they
// feed (no cast node between them); without autocast, their input's. The
// values are the norm rounded once (test_autograd holds them to f64).
TEST_F(ModelsTest, EachGptNormWritesTheDtypeOfTheLinearItFeeds) {
  SCOPED_TRACE(trace());
  nn::GPTOptions o;
  o.vocab_size = 7, o.context = 4, o.d_model = 8, o.n_layers = 1, o.n_heads = 2;
  nn::GPT model(o, &gen_);
  const Tensor idx = from_vector<int64_t>({1, 2, 3, 0, 6, 5}, {2, 3}, DType::i64);
  auto head_input = [](const Tensor& logits) { return logits.grad_fn()->next_edges()[0].node; };
  const Tensor plain = model.forward(idx);
  EXPECT_EQ(plain.dtype(), DType::f32);
  ASSERT_TRUE(plain.grad_fn());
  ASSERT_TRUE(head_input(plain));
  EXPECT_EQ(head_input(plain)->name(), "layer_norm");
  amp::AutocastGuard autocast(DeviceType::cpu, DType::bf16);
  const Tensor logits = model.forward(idx);
  EXPECT_EQ(logits.dtype(), DType::bf16);
  ASSERT_TRUE(logits.grad_fn());
  EXPECT_EQ(logits.grad_fn()->name(), "linear");
  ASSERT_TRUE(head_input(logits));
  EXPECT_EQ(head_input(logits)->name(), "layer_norm");
  EXPECT_LT(rel_error(host_f64(logits), host_f64(plain)), 0.05);
}

TEST_F(ModelsTest, LinearAndEmbeddingMatchReference) {
  SCOPED_TRACE(trace());
  nn::Linear lin(5, 3, true, &gen_);
  const Tensor x = randn({2, 4, 5}, DType::f32, kCPU, &gen_);
  const Vec xh = host_f64(x), w = host_f64(lin.weight), b = host_f64(lin.bias);
  Vec want(8 * 3);
  for (int r = 0; r < 8; ++r)
    for (int o = 0; o < 3; ++o) {
      double acc = b[o];
      for (int i = 0; i < 5; ++i) acc += xh[r * 5 + i] * w[o * 5 + i];
      want[r * 3 + o] = acc;
    }
  const Tensor y = lin.forward(x);
  EXPECT_EQ(y.shape(), (Shape{2, 4, 3}));
  EXPECT_LT(rel_error(host_f64(y), want), 1e-5);
  expect_contains(error_of<ShapeError>([&] { lin.forward(zeros({2, 4})); }), {"Linear(5, 3)", "f32[2, 4]"});

  nn::Embedding emb(6, 4, &gen_);
  const Tensor e = emb.forward(from_vector(std::vector<int64_t>{5, 0, 5}, {3}, DType::i64));
  const Vec table = host_f64(emb.weight), got = host_f64(e);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(got[i], table[5 * 4 + i]);
    EXPECT_EQ(got[4 + i], table[i]);
  }
  EXPECT_THROW(emb.forward(zeros({3})), DTypeError);
}

// f64 reference of the reference GPTBlock's attention half.
Vec attention_ref(const Vec& x, const Vec& wqkv, const Vec& bqkv, const Vec& wp, const Vec& bp, int64_t B,
                  int64_t T, int64_t C, int64_t H) {
  const int64_t D = C / H;
  Vec qkv(B * T * 3 * C), y(B * T * C, 0.0), out(B * T * C);
  for (int64_t r = 0; r < B * T; ++r)
    for (int64_t o = 0; o < 3 * C; ++o) {
      double acc = bqkv[o];
      for (int64_t i = 0; i < C; ++i) acc += x[r * C + i] * wqkv[o * C + i];
      qkv[r * 3 * C + o] = acc;
    }
  auto at = [&](int64_t b, int64_t t, int64_t part, int64_t h, int64_t d) {
    return qkv[(b * T + t) * 3 * C + part * C + h * D + d];
  };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        Vec s(t + 1);
        double mx = -INFINITY;
        for (int64_t u = 0; u <= t; ++u) {  // causal: keys up to t
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += at(b, t, 0, h, d) * at(b, u, 1, h, d);
          s[u] = dot / std::sqrt(static_cast<double>(D));
          mx = std::max(mx, s[u]);
        }
        double z = 0;
        for (double& v : s) z += (v = std::exp(v - mx));
        for (int64_t d = 0; d < D; ++d) {
          double acc = 0;
          for (int64_t u = 0; u <= t; ++u) acc += s[u] / z * at(b, u, 2, h, d);
          y[(b * T + t) * C + h * D + d] = acc;
        }
      }
  for (int64_t r = 0; r < B * T; ++r)
    for (int64_t o = 0; o < C; ++o) {
      double acc = bp[o];
      for (int64_t i = 0; i < C; ++i) acc += y[r * C + i] * wp[o * C + i];
      out[r * C + o] = acc;
    }
  return out;
}

TEST_F(ModelsTest, CausalSelfAttentionMatchesReference) {
  SCOPED_TRACE(trace());
  const int64_t B = 2, T = 5, C = 12, H = 3;
  nn::CausalSelfAttention attn(C, H, &gen_);
  EXPECT_EQ(attn.named_parameters().keys(),
            (std::vector<std::string>{"qkv.weight", "qkv.bias", "proj.weight", "proj.bias"}));
  EXPECT_EQ(attn.qkv->weight.shape(), (Shape{3 * C, C}));
  const Tensor x = randn({B, T, C}, DType::f32, kCPU, &gen_);
  const Tensor y = attn.forward(x);
  ASSERT_EQ(y.shape(), (Shape{B, T, C}));
  const Vec want = attention_ref(host_f64(x), host_f64(attn.qkv->weight), host_f64(attn.qkv->bias),
                                 host_f64(attn.proj->weight), host_f64(attn.proj->bias), B, T, C, H);
  EXPECT_LT(rel_error(host_f64(y), want), 1e-5);

  // Causality: changing the last position leaves earlier outputs alone.
  Vec xv = host_f64(x);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t c = 0; c < C; ++c) xv[(b * T + T - 1) * C + c] += 1.0;
  const Vec y2 = host_f64(attn.forward(from_vector(std::vector<float>(xv.begin(), xv.end()), {B, T, C})));
  const Vec y1 = host_f64(y);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t + 1 < T; ++t)
      for (int64_t c = 0; c < C; ++c)
        EXPECT_EQ(y2[(b * T + t) * C + c], y1[(b * T + t) * C + c]) << b << "," << t << "," << c;

  backward(sum(attn.forward(x)));
  for (const auto& [name, p] : attn.named_parameters()) EXPECT_TRUE(p.grad().defined()) << name;
  EXPECT_THROW(nn::CausalSelfAttention(10, 3), ValueError);
  EXPECT_THROW(attn.forward(zeros({2, 5, 8})), ShapeError);
}

// Layer norm of rows of C in f64 (eps 1e-5, the GPT's).
Vec layer_norm_rows(const Vec& x, const Vec& w, const Vec& b, int64_t C) {
  return testing::layer_norm_ref(x, w, b, C, 1e-5).y;
}

// Rows of `in` through x W^T + b (b empty: none), W [out, in].
Vec linear_rows(const Vec& x, const Vec& w, const Vec& b, int64_t in, int64_t out) {
  const int64_t rows = static_cast<int64_t>(x.size()) / in;
  Vec y(static_cast<size_t>(rows * out));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double acc = b.empty() ? 0.0 : b[o];
      for (int64_t i = 0; i < in; ++i) acc += x[r * in + i] * w[o * in + i];
      y[r * out + o] = acc;
    }
  return y;
}

// f64 reference of the whole GPT, from its parameters by name: token plus
// position rows; per block x += attention(ln1(x)) (attention_ref: the qkv
// projection, causal heads, proj) and x += out(gelu(fc(ln2(x)))) with the
// exact (erf) gelu; then the final norm and the head, which has no bias.
Vec gpt_ref(const nn::GPT& model, const std::vector<int64_t>& idx, int64_t B, int64_t T) {
  const auto params = model.named_parameters();
  auto p = [&](const std::string& name) { return host_f64(params.at(name)); };
  const int64_t C = model.options.d_model, H = model.options.n_heads;
  const Vec tok = p("tok.weight"), pos = p("pos.weight");
  Vec x(static_cast<size_t>(B * T * C));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < C; ++c) x[(b * T + t) * C + c] = tok[idx[b * T + t] * C + c] + pos[t * C + c];
  for (int64_t l = 0; l < model.options.n_layers; ++l) {
    const std::string in = "blocks." + std::to_string(l) + ".";
    const Vec a = layer_norm_rows(x, p(in + "ln1.weight"), p(in + "ln1.bias"), C);
    const Vec att = attention_ref(a, p(in + "qkv.weight"), p(in + "qkv.bias"), p(in + "proj.weight"),
                                  p(in + "proj.bias"), B, T, C, H);
    for (size_t i = 0; i < x.size(); ++i) x[i] += att[i];
    const Vec m = layer_norm_rows(x, p(in + "ln2.weight"), p(in + "ln2.bias"), C);
    Vec f = linear_rows(m, p(in + "fc.weight"), p(in + "fc.bias"), C, 4 * C);
    for (double& v : f) v = 0.5 * v * (1 + std::erf(v / std::sqrt(2.0)));
    const Vec mlp = linear_rows(f, p(in + "out.weight"), p(in + "out.bias"), 4 * C, C);
    for (size_t i = 0; i < x.size(); ++i) x[i] += mlp[i];
  }
  return linear_rows(layer_norm_rows(x, p("ln.weight"), p("ln.bias"), C), p("head.weight"), {}, C,
                     model.options.vocab_size);
}

// nn::GPT's forward against the f64 reference of its parameters, on a tiny
// config of two blocks of two heads. The norms' weights and biases are
// drawn too (they start at 1 and 0), so that one applied in the wrong place
// shows.
TEST_F(ModelsTest, GptMatchesAnF64ReferenceOfItsParameters) {
  SCOPED_TRACE(trace());
  nn::GPTOptions o;
  o.vocab_size = 11, o.context = 8, o.d_model = 16, o.n_layers = 2, o.n_heads = 2;
  nn::GPT model(o, &gen_);
  {
    NoGradGuard no_grad;
    for (const auto& [name, p] : model.named_parameters())
      if (name.find("ln") != std::string::npos)
        prim::copy_(p, prim::add_scalar(prim::mul_scalar(randn(p.shape(), DType::f32, kCPU, &gen_), 0.3),
                                        name.ends_with(".weight") ? 1.0 : 0.0));
  }
  const int64_t B = 2, T = 6;
  std::vector<int64_t> ids;
  for (double u : host_f64(rand({B * T}, DType::f64, kCPU, &gen_, 0.0, static_cast<double>(o.vocab_size))))
    ids.push_back(std::min<int64_t>(static_cast<int64_t>(u), o.vocab_size - 1));
  const Tensor logits = model.forward(from_vector(ids, {B, T}, DType::i64));
  ASSERT_EQ(logits.shape(), (Shape{B, T, o.vocab_size}));
  EXPECT_LT(rel_error(host_f64(logits), gpt_ref(model, ids, B, T)), 1e-4);
}

TEST_F(ModelsTest, SmallCnnRunsForwardAndBackward) {
  SCOPED_TRACE(trace());
  nn::Sequential cnn{std::make_shared<nn::Conv2d>(1, 4, 3, 1, 1, true, &gen_),
                     std::make_shared<nn::ReLU>(),
                     std::make_shared<nn::MaxPool2d>(2),
                     std::make_shared<nn::Conv2d>(4, 8, 3, 1, 1, true, &gen_),
                     std::make_shared<nn::GELU>(GeluApprox::tanh),
                     std::make_shared<nn::MaxPool2d>(2),
                     std::make_shared<nn::Flatten>(),
                     std::make_shared<nn::Linear>(8 * 2 * 2, 3, true, &gen_)};
  const Tensor x = randn({2, 1, 8, 8}, DType::f32, kCPU, &gen_);
  const Tensor y = cnn.forward(x);
  EXPECT_EQ(y.shape(), (Shape{2, 3}));
  backward(cross_entropy(y, from_vector(std::vector<int64_t>{0, 2}, {2}, DType::i64)));
  for (const auto& [name, p] : cnn.named_parameters()) {
    ASSERT_TRUE(p.grad().defined()) << name;
    EXPECT_EQ(p.grad().shape(), p.shape()) << name;
  }
  expect_contains(error_of<ShapeError>([&] { cnn.forward(zeros({2, 3, 8, 8})); }), {"Conv2d(1, 4, 3)", "[2, 3, 8, 8]"});
}

// ---- training end to end --------------------------------------------------------------------------------

// XOR of the quadrants: label 1 where x0 * x1 > 0. Not linearly separable,
// so a falling loss means the hidden layer learned something.
struct Dataset {
  Tensor x, y;
};
Dataset xor_data(int64_t n, Generator& gen) {
  const Tensor x = rand({n, 2}, DType::f32, kCPU, &gen, -1.0, 1.0);
  const Vec xv = host_f64(x);
  std::vector<int64_t> y(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) y[i] = xv[2 * i] * xv[2 * i + 1] > 0 ? 1 : 0;
  return {x, from_vector(y, {n}, DType::i64)};
}

struct TrainResult {
  double first_loss, last_loss, accuracy;
  std::vector<std::pair<std::string, std::vector<float>>> params;
};

TrainResult train_mlp(uint64_t seed, bool use_adamw) {
  Generator gen(seed);
  const Dataset data = xor_data(256, gen);
  nn::Sequential mlp{std::make_shared<nn::Linear>(2, 16, true, &gen), std::make_shared<nn::ReLU>(),
                     std::make_shared<nn::Linear>(16, 2, true, &gen)};
  std::unique_ptr<optim::Optimizer> opt;
  if (use_adamw) {
    opt = std::make_unique<optim::AdamW>(mlp.parameters(), optim::AdamWOptions{.lr = 0.02, .weight_decay = 0.0});
  } else {
    opt = std::make_unique<optim::SGD>(mlp.parameters(), optim::SGDOptions{.lr = 0.2, .momentum = 0.9});
  }
  TrainResult r{};
  for (int step = 0; step < 300; ++step) {
    opt->zero_grad();
    const Tensor loss = cross_entropy(mlp.forward(data.x), data.y);
    backward(loss);
    opt->step();
    if (step == 0) r.first_loss = loss.item();
    r.last_loss = loss.item();
  }
  NoGradGuard no_grad;
  const std::vector<int64_t> pred = prim::argmax(mlp.forward(data.x), 1).to_vector<int64_t>();
  const std::vector<int64_t> truth = data.y.to_vector<int64_t>();
  int correct = 0;
  for (size_t i = 0; i < pred.size(); ++i) correct += pred[i] == truth[i];
  r.accuracy = static_cast<double>(correct) / pred.size();
  r.params = snapshot(mlp);
  return r;
}

TEST_F(ModelsTest, TinyMlpLearnsXorAndIsBitReproducible) {
  SCOPED_TRACE(trace());
  for (bool adamw : {true, false}) {
    SCOPED_TRACE(adamw ? "AdamW" : "SGD momentum");
    const TrainResult a = train_mlp(seed_, adamw);
    EXPECT_GT(a.first_loss, 0.5);
    EXPECT_LT(a.last_loss, 0.2 * a.first_loss) << "first " << a.first_loss << " last " << a.last_loss;
    EXPECT_GT(a.accuracy, 0.9);
    const TrainResult b = train_mlp(seed_, adamw);
    EXPECT_EQ(a.last_loss, b.last_loss);
    ASSERT_EQ(a.params.size(), b.params.size());
    for (size_t i = 0; i < a.params.size(); ++i) {
      EXPECT_EQ(a.params[i].first, b.params[i].first);
      ASSERT_EQ(a.params[i].second.size(), b.params[i].second.size());
      EXPECT_EQ(std::memcmp(a.params[i].second.data(), b.params[i].second.data(), a.params[i].second.size() * 4), 0)
          << a.params[i].first << " differs between two runs with seed " << seed_;
    }
  }
}

}  // namespace
}  // namespace mpt
