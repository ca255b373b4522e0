// Optimizers, gradient clipping and lr schedules against hand-written f64
// references of PyTorch's rules, on fresh random parameters and gradients
// every run (the seed is printed on failure).
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "autograd/engine.h"
#include "autograd/ops.h"
#include "models/adamw.h"
#include "models/clip_grad.h"
#include "models/layers.h"
#include "models/lr_schedule.h"
#include "models/sgd.h"
#include "tensor/graph.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

using testing::host_f64;
using testing::rel_error;
using Vec = std::vector<double>;

// Fresh random parameters and per-step gradients, with their host copies.
class OptimTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = testing::fresh_seed();
    gen_.manual_seed(seed_);
  }
  std::string trace() const { return fmt::format("seed {}", seed_); }
  Tensor param(const Shape& s) {
    Tensor p = randn(s, DType::f32, kCPU, &gen_);
    p.set_requires_grad(true);
    return p;
  }
  // A gradient rounded to `dt`, as a mixed-precision backward would leave it.
  Tensor grad_like(const Tensor& p, DType dt = DType::f32, double scale = 1.0) {
    return prim::to(prim::mul_scalar(randn(p.shape(), DType::f32, kCPU, &gen_), scale), dt);
  }

  uint64_t seed_ = 0;
  Generator gen_;
};

// ---- f64 references of PyTorch's update rules ---------------------------------------------

struct SgdRef {
  double lr, momentum, dampening, wd;
  bool nesterov;
  Vec buf;
  bool has_buf = false;
  void step(Vec& p, const Vec& g) {
    Vec d = g;
    for (size_t i = 0; i < p.size(); ++i) d[i] += wd * p[i];
    if (momentum != 0) {
      if (!has_buf) {
        buf = d;
        has_buf = true;
      } else {
        for (size_t i = 0; i < p.size(); ++i) buf[i] = momentum * buf[i] + (1 - dampening) * d[i];
      }
      for (size_t i = 0; i < p.size(); ++i) d[i] = nesterov ? d[i] + momentum * buf[i] : buf[i];
    }
    for (size_t i = 0; i < p.size(); ++i) p[i] -= lr * d[i];
  }
};

struct AdamWRef {
  double lr, b1, b2, eps, wd;
  Vec m, v;
  int t = 0;
  void step(Vec& p, const Vec& g) {
    if (m.empty()) m.assign(p.size(), 0.0), v.assign(p.size(), 0.0);
    ++t;
    const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
    for (size_t i = 0; i < p.size(); ++i) {
      p[i] *= 1 - lr * wd;
      m[i] = b1 * m[i] + (1 - b1) * g[i];
      v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
      p[i] -= lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + eps);
    }
  }
};

Vec minus(const Vec& a, const Vec& b) {
  Vec d(a.size());
  for (size_t i = 0; i < a.size(); ++i) d[i] = a[i] - b[i];
  return d;
}

// Compares the displacement from the start, which is what the rule
// computes; comparing the parameters themselves would hide a wrong update
// behind the size of the initial values. Each element may differ from the
// f64 reference by `tol` times the largest displacement (f32 arithmetic in
// the update) plus half an f32 ulp of the parameter per rounding (the
// parameter is stored in f32 after every step, and a second time within the
// step where AdamW's decoupled weight decay shrinks it first; with small
// learning rates that rounding is the larger term).
void expect_trajectory_close(const Tensor& p, const Vec& ref, const Vec& start, double tol, int steps,
                             int roundings_per_step = 1) {
  const Vec got = host_f64(p);
  double max_disp = 0;
  for (size_t i = 0; i < ref.size(); ++i) max_disp = std::max(max_disp, std::fabs(ref[i] - start[i]));
  ASSERT_GT(max_disp, 0.0) << "the reference did not move";
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double storage = steps * roundings_per_step * 0x1p-24 * std::max(std::fabs(got[i]), std::fabs(ref[i]));
    const double ratio = std::fabs(got[i] - ref[i]) / (tol * max_disp + storage);
    if (ratio > worst) worst = ratio, at = i;
  }
  EXPECT_LE(worst, 1.0) << "after " << steps << " steps, element " << at << ": got " << got[at] << ", reference "
                        << ref[at] << ", start " << start[at] << " (error / allowed = " << worst << ")";
}

// ---- SGD ------------------------------------------------------------------------------------------

struct SgdCase {
  double momentum, dampening, wd;
  bool nesterov;
};

TEST_F(OptimTest, SgdMatchesReferenceAcrossVariants) {
  SCOPED_TRACE(trace());
  const SgdCase cases[] = {{0, 0, 0, false},   {0, 0, 0.05, false},  {0.9, 0, 0, false},
                           {0.9, 0.3, 0, false}, {0.9, 0, 0, true},  {0.8, 0, 0.02, true},
                           {0.5, 0.1, 0.01, false}};
  for (const SgdCase& c : cases) {
    SCOPED_TRACE(fmt::format("momentum {} dampening {} wd {} nesterov {}", c.momentum, c.dampening, c.wd,
                             c.nesterov));
    std::vector<Tensor> params = {param({7, 5}), param({13})};
    const double lr = 0.1;
    optim::SGD opt(params, {.lr = lr, .momentum = c.momentum, .dampening = c.dampening, .weight_decay = c.wd,
                            .nesterov = c.nesterov});
    std::vector<Vec> ref, start;
    std::vector<SgdRef> rules;
    for (const Tensor& p : params) {
      ref.push_back(host_f64(p));
      start.push_back(ref.back());
      rules.push_back(SgdRef{lr, c.momentum, c.dampening, c.wd, c.nesterov, {}});
    }
    for (int step = 0; step < 6; ++step) {
      for (size_t i = 0; i < params.size(); ++i) {
        const Tensor g = grad_like(params[i]);
        params[i].set_grad(g);
        rules[i].step(ref[i], host_f64(g));
      }
      opt.step();
      for (size_t i = 0; i < params.size(); ++i) expect_trajectory_close(params[i], ref[i], start[i], 1e-5, step + 1);
    }
    if (c.momentum != 0) {
      EXPECT_TRUE(opt.state(0).buffers.contains("momentum_buffer"));
      EXPECT_LT(rel_error(host_f64(opt.state(0).buffers.at("momentum_buffer")), rules[0].buf), 1e-5);
    } else {
      EXPECT_FALSE(opt.state(0).buffers.contains("momentum_buffer"));
    }
  }
}

TEST_F(OptimTest, SgdFirstMomentumStepUsesTheGradientAsBuffer) {
  SCOPED_TRACE(trace());
  // With dampening, PyTorch's first buffer is the raw gradient, not
  // (1 - dampening) * g; a rule that starts from zeros would differ here.
  Tensor p = param({9});
  const Vec p0 = host_f64(p);
  optim::SGD opt({p}, {.lr = 0.5, .momentum = 0.9, .dampening = 0.5});
  const Tensor g = grad_like(p);
  p.set_grad(g);
  opt.step();
  const Vec gh = host_f64(g), ph = host_f64(p);
  for (size_t i = 0; i < ph.size(); ++i) EXPECT_NEAR(ph[i], p0[i] - 0.5 * gh[i], 1e-6);
}

TEST_F(OptimTest, SgdLeavesTheGradientUntouched) {
  SCOPED_TRACE(trace());
  Tensor p = param({6});
  optim::SGD opt({p}, {.lr = 0.1, .momentum = 0.9, .weight_decay = 0.1, .nesterov = true});
  const Tensor g = grad_like(p);
  const Vec before = host_f64(g);
  p.set_grad(g);
  opt.step();
  opt.step();
  EXPECT_EQ(host_f64(p.grad()), before);
}

// ---- AdamW --------------------------------------------------------------------------------------------

TEST_F(OptimTest, AdamWMatchesReference) {
  SCOPED_TRACE(trace());
  struct Case {
    double lr, b1, b2, eps, wd;
  };
  const Case cases[] = {{1e-2, 0.9, 0.999, 1e-8, 0.01}, {5e-2, 0.8, 0.99, 1e-6, 0.1}, {1e-3, 0.0, 0.5, 1e-8, 0.0}};
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("lr {} betas ({}, {}) eps {} wd {}", c.lr, c.b1, c.b2, c.eps, c.wd));
    std::vector<Tensor> params = {param({4, 6}), param({11}), param({1})};
    optim::AdamW opt(params, {.lr = c.lr, .beta1 = c.b1, .beta2 = c.b2, .eps = c.eps, .weight_decay = c.wd});
    std::vector<Vec> ref, start;
    std::vector<AdamWRef> rules;
    for (const Tensor& p : params) {
      ref.push_back(host_f64(p));
      start.push_back(ref.back());
      rules.push_back(AdamWRef{c.lr, c.b1, c.b2, c.eps, c.wd, {}, {}});
    }
    for (int step = 0; step < 8; ++step) {
      for (size_t i = 0; i < params.size(); ++i) {
        const Tensor g = grad_like(params[i], DType::f32, 0.1);
        params[i].set_grad(g);
        rules[i].step(ref[i], host_f64(g));
      }
      opt.step();
      for (size_t i = 0; i < params.size(); ++i)
        expect_trajectory_close(params[i], ref[i], start[i], 1e-5, step + 1, c.wd != 0 ? 2 : 1);
    }
    EXPECT_EQ(opt.state(0).step, 8);
    EXPECT_LT(rel_error(host_f64(opt.state(1).buffers.at("exp_avg")), rules[1].m), 1e-5);
    EXPECT_LT(rel_error(host_f64(opt.state(1).buffers.at("exp_avg_sq")), rules[1].v), 1e-5);
  }
}

TEST_F(OptimTest, AdamWCastsHalfGradientsToTheParameterDtype) {
  SCOPED_TRACE(trace());
  for (DType dt : {DType::f16, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor p = param({8, 3});
    const Vec start = host_f64(p);
    Vec ref = start;
    AdamWRef rule{1e-2, 0.9, 0.999, 1e-8, 0.01, {}, {}};
    optim::AdamW opt({p}, {.lr = 1e-2});
    for (int step = 0; step < 4; ++step) {
      const Tensor g = grad_like(p, dt);
      p.set_grad(g);
      rule.step(ref, host_f64(g));  // the reference sees the rounded gradient
      opt.step();
      EXPECT_EQ(p.dtype(), DType::f32);
      EXPECT_EQ(opt.state(0).buffers.at("exp_avg").dtype(), DType::f32);
      expect_trajectory_close(p, ref, start, 1e-5, step + 1);
    }
  }
}

TEST_F(OptimTest, ParametersWithoutGradientAreSkippedWithTheirOwnStepCount) {
  SCOPED_TRACE(trace());
  Tensor a = param({5}), b = param({3});
  const Vec a0 = host_f64(a), b0 = host_f64(b);
  Vec ra = a0, rb = b0;
  AdamWRef rule_a{0.05, 0.9, 0.999, 1e-8, 0.01, {}, {}}, rule_b = rule_a;
  optim::AdamW opt({a, b}, {.lr = 0.05});
  for (int step = 0; step < 5; ++step) {
    const Tensor ga = grad_like(a);
    a.set_grad(ga);
    rule_a.step(ra, host_f64(ga));
    if (step >= 2) {  // b joins late: its bias correction must start at t = 1
      const Tensor gb = grad_like(b);
      b.set_grad(gb);
      rule_b.step(rb, host_f64(gb));
    }
    opt.step();
    if (step < 2) {
      EXPECT_EQ(host_f64(b), b0) << "a parameter without a gradient must not move (not even by weight decay)";
      EXPECT_EQ(opt.state(1).step, 0);
    }
  }
  EXPECT_EQ(opt.state(0).step, 5);
  EXPECT_EQ(opt.state(1).step, 3);
  expect_trajectory_close(a, ra, a0, 1e-5, 5);
  expect_trajectory_close(b, rb, b0, 1e-5, 3);
}

TEST_F(OptimTest, GroupsHaveTheirOwnLearningRateAndDecay) {
  SCOPED_TRACE(trace());
  Tensor w = param({4, 4}), bias = param({4});
  const Vec w0 = host_f64(w), b0 = host_f64(bias);
  Vec rw = w0, rb = b0;
  SgdRef rule_w{0.1, 0, 0, 0.5, false, {}}, rule_b{0.01, 0, 0, 0.0, false, {}};
  optim::SGD opt(std::vector<optim::ParamGroup>{{{w}, std::nullopt, std::nullopt}, {{bias}, 0.01, 0.0}},
                 {.lr = 0.1, .weight_decay = 0.5});
  EXPECT_EQ(opt.num_groups(), 2u);
  EXPECT_DOUBLE_EQ(opt.lr(0), 0.1);
  EXPECT_DOUBLE_EQ(opt.lr(1), 0.01);
  EXPECT_DOUBLE_EQ(opt.weight_decay(1), 0.0);
  for (int step = 0; step < 3; ++step) {
    const Tensor gw = grad_like(w), gb = grad_like(bias);
    w.set_grad(gw);
    bias.set_grad(gb);
    rule_w.step(rw, host_f64(gw));
    rule_b.step(rb, host_f64(gb));
    opt.step();
  }
  expect_trajectory_close(w, rw, w0, 1e-5, 3);
  expect_trajectory_close(bias, rb, b0, 1e-5, 3);
  opt.set_lr(0.2);
  EXPECT_DOUBLE_EQ(opt.lr(0), 0.2);
  EXPECT_DOUBLE_EQ(opt.lr(1), 0.2);
  opt.set_lr(1, 0.3);
  EXPECT_DOUBLE_EQ(opt.lr(1), 0.3);
}

TEST_F(OptimTest, ZeroGradDropsGradients) {
  SCOPED_TRACE(trace());
  Tensor a = param({3}), b = param({2});
  optim::SGD opt({a, b}, {.lr = 0.1});
  a.set_grad(grad_like(a));
  b.set_grad(grad_like(b));
  opt.zero_grad();
  EXPECT_FALSE(a.grad().defined());
  EXPECT_FALSE(b.grad().defined());
  const Vec before = host_f64(a);
  opt.step();  // nothing to do
  EXPECT_EQ(host_f64(a), before);
}

// ---- validation and messages ------------------------------------------------------------------------

template <typename E, typename F>
void expect_error(F&& f, const std::vector<std::string>& fragments) {
  try {
    f();
    ADD_FAILURE() << "no exception";
  } catch (const E& e) {
    for (const std::string& s : fragments)
      EXPECT_NE(std::string(e.what()).find(s), std::string::npos) << "'" << s << "' not in: " << e.what();
  }
}

TEST_F(OptimTest, HyperParametersAreValidated) {
  Tensor p = param({2});
  expect_error<ValueError>([&] { optim::SGD({p}, {.lr = -0.5}); }, {"SGD", "learning rate", "-0.5"});
  expect_error<ValueError>([&] { optim::SGD({p}, {.lr = 0.1, .momentum = -0.9}); }, {"momentum", "-0.9"});
  expect_error<ValueError>([&] { optim::SGD({p}, {.lr = 0.1, .nesterov = true}); }, {"nesterov"});
  expect_error<ValueError>([&] { optim::SGD({p}, {.lr = 0.1, .momentum = 0.9, .dampening = 0.1, .nesterov = true}); },
                           {"nesterov", "dampening"});
  expect_error<ValueError>([&] { optim::SGD({p}, {.lr = 0.1, .weight_decay = -1}); }, {"weight_decay", "-1"});
  expect_error<ValueError>([&] { optim::AdamW({p}, {.lr = -1e-3}); }, {"AdamW", "learning rate", "-0.001"});
  expect_error<ValueError>([&] { optim::AdamW({p}, {.beta1 = 1.0}); }, {"beta1", "1"});
  expect_error<ValueError>([&] { optim::AdamW({p}, {.beta2 = -0.1}); }, {"beta2", "-0.1"});
  expect_error<ValueError>([&] { optim::AdamW({p}, {.eps = -1e-8}); }, {"eps", "-1e-08"});
  expect_error<ValueError>([&] { optim::AdamW(std::vector<Tensor>{}); }, {"empty"});
  expect_error<ValueError>([&] { optim::AdamW({p, p}); }, {"more than once"});
  optim::SGD opt({p}, {.lr = 0.1});
  expect_error<ValueError>([&] { opt.set_lr(-2.0); }, {"learning rate", "-2"});
  EXPECT_DOUBLE_EQ(opt.lr(), 0.1);
}

TEST_F(OptimTest, MismatchedGradientNamesTheParameter) {
  SCOPED_TRACE(trace());
  nn::Linear layer(3, 2, true, &gen_);
  const auto named = layer.named_parameters();  // stamps the names
  optim::AdamW opt(layer.parameters());
  layer.weight.set_grad(zeros({3, 2}));
  expect_error<ShapeError>([&] { opt.step(); }, {"AdamW", "'weight'", "[3, 2]", "[2, 3]"});
}

// ---- optimizer state dict --------------------------------------------------------------------------

std::vector<Tensor> clones(const std::vector<Tensor>& ts) {
  std::vector<Tensor> out;
  for (const Tensor& t : ts) {
    Tensor c = prim::clone(t);
    c.set_requires_grad(true);
    out.push_back(c);
  }
  return out;
}

TEST_F(OptimTest, AdamWStateDictRoundTripContinuesBitIdentically) {
  SCOPED_TRACE(trace());
  std::vector<Tensor> params = {param({3, 4}), param({4}), param({2})};
  auto make_groups = [](const std::vector<Tensor>& ps) {
    return std::vector<optim::ParamGroup>{{{ps[0]}, std::nullopt, std::nullopt}, {{ps[1], ps[2]}, 3e-2, 0.0}};
  };
  optim::AdamW a(make_groups(params), {.lr = 1e-2});
  std::vector<std::vector<Tensor>> grads;
  for (int step = 0; step < 6; ++step) {
    std::vector<Tensor> gs;
    for (const Tensor& p : params) gs.push_back(grad_like(p));
    grads.push_back(gs);
  }
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < params.size(); ++i) params[i].set_grad(step == 1 && i == 2 ? Tensor() : grads[step][i]);
    a.step();
  }
  a.set_lr(0, 7e-3);

  // Snapshot (the dict holds live buffers), then resume in a fresh optimizer
  // built with different hyper-parameters: the dict's must win.
  optim::StateDict saved;
  for (const auto& [k, t] : a.state_dict()) saved.insert(k, prim::clone(t));
  EXPECT_TRUE(saved.contains("group.0.lr"));
  EXPECT_TRUE(saved.contains("group.1.weight_decay"));
  EXPECT_TRUE(saved.contains("state.2.exp_avg_sq"));
  EXPECT_EQ(saved.at("state.0.step").item(), 3.0);
  EXPECT_EQ(saved.at("state.2.step").item(), 2.0);
  EXPECT_EQ(saved.at("state.2.step").dtype(), DType::i64);

  std::vector<Tensor> resumed = clones(params);
  optim::AdamW b(make_groups(resumed), {.lr = 0.5, .weight_decay = 0.3});
  b.load_state_dict(saved);
  EXPECT_DOUBLE_EQ(b.lr(0), 7e-3);
  EXPECT_DOUBLE_EQ(b.lr(1), 3e-2);
  EXPECT_DOUBLE_EQ(b.weight_decay(0), 1e-2);
  EXPECT_DOUBLE_EQ(b.weight_decay(1), 0.0);
  EXPECT_EQ(b.state(2).step, 2);

  for (int step = 3; step < 6; ++step) {
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].set_grad(grads[step][i]);
      resumed[i].set_grad(grads[step][i]);
    }
    a.step();
    b.step();
  }
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_EQ(params[i].to_vector<float>(), resumed[i].to_vector<float>()) << "param " << i;
  // The loaded buffers are private copies, not the dict's tensors.
  EXPECT_NE(host_f64(saved.at("state.0.exp_avg")), host_f64(b.state(0).buffers.at("exp_avg")));
}

TEST_F(OptimTest, SgdStateDictRoundTrip) {
  SCOPED_TRACE(trace());
  std::vector<Tensor> params = {param({5}), param({2, 2})};
  optim::SGD a(params, {.lr = 0.1, .momentum = 0.9, .nesterov = true});
  for (Tensor& p : params) p.set_grad(grad_like(p));
  a.step();
  optim::StateDict saved;
  for (const auto& [k, t] : a.state_dict()) saved.insert(k, prim::clone(t));
  EXPECT_TRUE(saved.contains("state.1.momentum_buffer"));
  std::vector<Tensor> resumed = clones(params);
  optim::SGD b(resumed, {.lr = 0.1, .momentum = 0.9, .nesterov = true});
  b.load_state_dict(saved);
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor g = grad_like(params[i]);
    params[i].set_grad(g);
    resumed[i].set_grad(g);
  }
  a.step();
  b.step();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(params[i].to_vector<float>(), resumed[i].to_vector<float>());
}

TEST_F(OptimTest, BadOptimizerStateDictChangesNothing) {
  SCOPED_TRACE(trace());
  std::vector<Tensor> params = {param({3}), param({2, 2})};
  optim::AdamW opt(params, {.lr = 1e-2});
  for (Tensor& p : params) p.set_grad(grad_like(p));
  opt.step();
  const optim::StateDict good = opt.state_dict();
  const Vec m_before = host_f64(opt.state(1).buffers.at("exp_avg"));

  auto with = [&](const std::string& key, const Tensor& t) {
    optim::StateDict d;
    for (const auto& [k, v] : good) d.insert(k, k == key ? t : v);
    if (!d.contains(key)) d.insert(key, t);
    return d;
  };
  auto without = [&](const std::string& key) {
    optim::StateDict d;
    for (const auto& [k, v] : good)
      if (k != key) d.insert(k, v);
    return d;
  };
  // Each bad dict also carries a changed lr, which must not be applied.
  auto expect_rejected = [&](optim::StateDict d, const std::vector<std::string>& fragments) {
    d.insert_or_assign("group.0.lr", scalar_tensor(0.5, DType::f64));
    expect_error<ValueError>([&] { opt.load_state_dict(d); }, fragments);
    EXPECT_DOUBLE_EQ(opt.lr(), 1e-2);
    EXPECT_EQ(host_f64(opt.state(1).buffers.at("exp_avg")), m_before);
    EXPECT_EQ(opt.state(1).step, 1);
  };
  expect_rejected(with("state.1.exp_avg", zeros({4})), {"state.1.exp_avg", "f32[4]", "f32[2, 2]"});
  expect_rejected(with("state.7.exp_avg", zeros({3})), {"state.7.exp_avg", "2 parameter"});
  expect_rejected(with("state.0.momentum_buffer", zeros({3})), {"state.0.momentum_buffer", "momentum_buffer"});
  expect_rejected(with("group.3.lr", scalar_tensor(0.1, DType::f64)), {"group.3.lr", "1 group"});
  expect_rejected(with("bogus", zeros({1})), {"unexpected key 'bogus'"});
  expect_rejected(without("group.0.weight_decay"), {"missing key 'group.0.weight_decay'"});
  // A state cut short is refused whole, not found missing in the middle of a step.
  expect_rejected(without("state.1.exp_avg_sq"), {"parameter 1", "1 of the buffers exp_avg, exp_avg_sq"});
  expect_rejected(without("state.1.step"), {"missing key 'state.1.step'"});
  expect_rejected(with("state.1.step", scalar_tensor(1e300, DType::f64)), {"state.1.step", "count", "1e+300"});
  // Steps without the moments they made: SGD's state without momentum, say.
  optim::StateDict steps_only;
  for (const auto& [k, v] : good)
    if (k != "state.1.exp_avg" && k != "state.1.exp_avg_sq") steps_only.insert(k, v);
  expect_rejected(steps_only, {"parameter 1", "took 1 steps", "none of its buffers"});
  // SGD without momentum keeps no buffers: its counts alone are its state.
  optim::SGD plain(params, {.lr = 0.1, .momentum = 0.0});
  for (Tensor& p : params) p.set_grad(grad_like(p));
  plain.step();
  optim::SGD other(params, {.lr = 0.1, .momentum = 0.0});
  other.load_state_dict(plain.state_dict());
  EXPECT_EQ(other.state(1).step, 1);
}

// ---- clip_grad_norm_ ---------------------------------------------------------------------------------

double ref_norm(const std::vector<Vec>& gs, double p) {
  double acc = 0;
  for (const Vec& g : gs)
    for (double x : g) acc = std::isinf(p) ? std::max(acc, std::fabs(x)) : acc + std::pow(std::fabs(x), p);
  return std::isinf(p) ? acc : std::pow(acc, 1.0 / p);
}

TEST_F(OptimTest, ClipGradNormMatchesReference) {
  SCOPED_TRACE(trace());
  for (double norm_type : {2.0, 1.0, 3.0, nn::kInfNorm}) {
    for (DType dt : {DType::f32, DType::f16}) {
      SCOPED_TRACE(fmt::format("norm {} grads {}", norm_type, dtype_name(dt)));
      std::vector<Tensor> params = {param({10, 7}), param({31}), param({4}), param({3})};
      for (size_t i = 0; i + 1 < params.size(); ++i) params[i].set_grad(grad_like(params[i], dt, 3.0));
      // params[3] has no gradient: skipped, not an error.
      std::vector<Vec> gs;
      for (size_t i = 0; i + 1 < params.size(); ++i) gs.push_back(host_f64(params[i].grad()));
      const double expected = ref_norm(gs, norm_type);

      // Above the norm: untouched, same values.
      EXPECT_NEAR(nn::clip_grad_norm_(params, expected * 2, norm_type), expected, 1e-5 * expected);
      for (size_t i = 0; i + 1 < params.size(); ++i) EXPECT_EQ(host_f64(params[i].grad()), gs[i]);

      // Below: every gradient scaled by max_norm / (total + 1e-6).
      const double max_norm = expected / 4;
      const double total = nn::clip_grad_norm_(params, max_norm, norm_type);
      EXPECT_NEAR(total, expected, 1e-5 * expected);
      const double scale = max_norm / (expected + 1e-6);
      std::vector<Vec> clipped;
      for (size_t i = 0; i + 1 < params.size(); ++i) {
        Vec want = gs[i];
        for (double& x : want) x *= scale;
        EXPECT_LT(rel_error(host_f64(params[i].grad()), want), testing::tolerance(dt)) << "grad " << i;
        EXPECT_EQ(params[i].grad().dtype(), dt);
        clipped.push_back(host_f64(params[i].grad()));
      }
      EXPECT_NEAR(ref_norm(clipped, norm_type), max_norm, 4 * testing::tolerance(dt) * max_norm);
      EXPECT_FALSE(params[3].grad().defined());
    }
  }
}

TEST_F(OptimTest, ClipGradNormEdgeCases) {
  Tensor p = param({3});
  EXPECT_EQ(nn::clip_grad_norm_({p}, 1.0), 0.0);  // no gradients at all
  p.set_grad(from_vector({3.0f, 4.0f, 0.0f}, {3}));
  EXPECT_NEAR(nn::clip_grad_norm_({p}, 1.0), 5.0, 1e-6);
  const Vec g = host_f64(p.grad());
  EXPECT_NEAR(g[0], 3.0 / (5.0 + 1e-6), 1e-6);
  EXPECT_NEAR(g[1], 4.0 / (5.0 + 1e-6), 1e-6);
  expect_error<ValueError>([&] { nn::clip_grad_norm_({p}, -1.0); }, {"max_norm", "-1"});
  expect_error<ValueError>([&] { nn::clip_grad_norm_({p}, 1.0, 0.0); }, {"norm_type"});

  // A non-finite total is returned as it is and, as in PyTorch, poisons the
  // gradients for a loss scaler to see. An infinite total scales by 0: the
  // infinite element becomes NaN, the finite ones 0. A NaN total scales by
  // NaN (torch.clamp keeps it): every element becomes NaN.
  Tensor q = param({2});
  q.set_grad(from_vector({1.0f, 2.0f}, {2}));
  p.set_grad(from_vector({3.0f, INFINITY, 0.0f}, {3}));
  EXPECT_TRUE(std::isinf(nn::clip_grad_norm_({p, q}, 1.0)));
  const Vec poisoned = host_f64(p.grad());
  EXPECT_EQ(poisoned[0], 0.0);
  EXPECT_TRUE(std::isnan(poisoned[1]));
  EXPECT_EQ(host_f64(q.grad()), (Vec{0.0, 0.0}));
  p.set_grad(from_vector({3.0f, NAN, 0.0f}, {3}));
  q.set_grad(from_vector({1.0f, 2.0f}, {2}));
  EXPECT_TRUE(std::isnan(nn::clip_grad_norm_({p, q}, 1.0)));
  for (const Tensor& t : {p, q})
    for (double v : host_f64(t.grad())) EXPECT_TRUE(std::isnan(v)) << v;
}

// f64 gradients are measured in f64, as PyTorch measures them: in f32,
// 1e20 squares to infinity and 1e-30 to zero.
TEST_F(OptimTest, ClipGradNormOfF64GradientsIsF64) {
  for (const double v : {1e20, 1e-30}) {
    SCOPED_TRACE(v);
    Tensor p = from_vector(std::vector<double>{0.0, 0.0}, {2}, DType::f64);
    p.set_requires_grad(true);
    p.set_grad(from_vector(std::vector<double>{3 * v, 4 * v}, {2}, DType::f64));
    EXPECT_NEAR(nn::clip_grad_norm_({p}, 1e300), 5 * v, 1e-12 * 5 * v);
    EXPECT_NEAR(nn::clip_grad_norm_({p}, 1e300, 3.0), std::cbrt(91.0) * v, 1e-12 * 5 * v);
  }
}

// ---- learning-rate schedules -----------------------------------------------------------------------

TEST(LrSchedule, CosineWithWarmupBoundaries) {
  const auto s = optim::LrSchedule::cosine(1.0, 10, 110, 0.1);
  EXPECT_DOUBLE_EQ(s.lr_at(0), 0.1);  // (0 + 1) / 10
  EXPECT_DOUBLE_EQ(s.lr_at(4), 0.5);
  EXPECT_DOUBLE_EQ(s.lr_at(9), 1.0);  // warm-up ends at the peak
  EXPECT_DOUBLE_EQ(s.lr_at(10), 1.0);  // decay starts at the peak
  EXPECT_NEAR(s.lr_at(60), 0.55, 1e-12);  // half way: (max + min) / 2
  EXPECT_NEAR(s.lr_at(35), 0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi / 4)), 1e-12);
  EXPECT_GT(s.lr_at(109), 0.1);
  EXPECT_NEAR(s.lr_at(109), 0.1, 1e-3);
  EXPECT_DOUBLE_EQ(s.lr_at(110), 0.1);
  EXPECT_DOUBLE_EQ(s.lr_at(100000), 0.1);
  for (int64_t t = 10; t < 120; ++t) EXPECT_LE(s.lr_at(t + 1), s.lr_at(t)) << t;
  for (int64_t t = 0; t < 9; ++t) EXPECT_LT(s.lr_at(t), s.lr_at(t + 1)) << t;

  const auto no_warmup = optim::LrSchedule::cosine(3e-4, 0, 100);
  EXPECT_DOUBLE_EQ(no_warmup.lr_at(0), 3e-4);
  EXPECT_DOUBLE_EQ(no_warmup.lr_at(100), 0.0);

  const auto constant = optim::LrSchedule::constant(0.25);
  EXPECT_DOUBLE_EQ(constant.lr_at(0), 0.25);
  EXPECT_DOUBLE_EQ(constant.lr_at(123456), 0.25);
}

TEST(LrSchedule, LinearWithWarmupBoundaries) {
  const auto s = optim::LrSchedule::linear(1.0, 10, 110, 0.1);
  EXPECT_DOUBLE_EQ(s.lr_at(0), 0.1);  // the cosine's warm-up: (0 + 1) / 10
  EXPECT_DOUBLE_EQ(s.lr_at(9), 1.0);
  EXPECT_DOUBLE_EQ(s.lr_at(10), 1.0);  // decay starts at the peak
  EXPECT_NEAR(s.lr_at(60), 0.55, 1e-12);  // half way
  EXPECT_NEAR(s.lr_at(35), 0.1 + 0.9 * 0.75, 1e-12);  // a quarter of the way: a straight line
  EXPECT_NEAR(s.lr_at(109), 0.1 + 0.9 / 100, 1e-12);
  EXPECT_DOUBLE_EQ(s.lr_at(110), 0.1);
  EXPECT_DOUBLE_EQ(s.lr_at(100000), 0.1);
  for (int64_t t = 10; t < 109; ++t)  // equal steps down
    EXPECT_NEAR(s.lr_at(t) - s.lr_at(t + 1), 0.009, 1e-12) << t;
  EXPECT_THROW(optim::LrSchedule::linear(1.0, 5, 5), ValueError);
  EXPECT_THROW(optim::LrSchedule::linear(1.0, 0, 5, 2.0), ValueError);
  EXPECT_THROW(optim::LrSchedule::linear(-1.0, 0, 5), ValueError);
}

TEST(LrSchedule, ValidatesAndApplies) {
  EXPECT_THROW(optim::LrSchedule::cosine(1.0, 10, 5), ValueError);
  EXPECT_THROW(optim::LrSchedule::cosine(1.0, 0, 0), ValueError);  // every step would be at min_lr
  EXPECT_THROW(optim::LrSchedule::cosine(1.0, 5, 5), ValueError);
  EXPECT_THROW(optim::LrSchedule::cosine(1.0, 0, 5, 2.0), ValueError);
  EXPECT_THROW(optim::LrSchedule::cosine(-1.0, 0, 5), ValueError);
  EXPECT_THROW(optim::LrSchedule::constant(-1.0), ValueError);
  EXPECT_THROW(optim::LrSchedule::constant(1.0).lr_at(-1), ValueError);

  Tensor a = zeros({2}), b = zeros({2});
  a.set_requires_grad(true);
  b.set_requires_grad(true);
  optim::SGD opt(std::vector<optim::ParamGroup>{{{a}, std::nullopt, std::nullopt}, {{b}, 0.5, std::nullopt}},
                 {.lr = 1.0});
  // Steps whose lr is neither group's starting lr (1.0 and 0.5): warm-up
  // step 2 gives the first group 2.0 * 3 / 4 = 1.5, step 3 the peak 2.0;
  // the second group, made at half the first's lr, stays at half.
  const auto s = optim::LrSchedule::cosine(2.0, 4, 20);
  s.apply(opt, 2);
  EXPECT_DOUBLE_EQ(opt.lr(0), 1.5);
  EXPECT_DOUBLE_EQ(opt.lr(1), 0.75);
  // And the next step uses them.
  a.set_grad(ones({2}));
  b.set_grad(ones({2}));
  opt.step();
  EXPECT_EQ(a.to_vector<float>(), (std::vector<float>{-1.5f, -1.5f}));
  EXPECT_EQ(b.to_vector<float>(), (std::vector<float>{-0.75f, -0.75f}));
  s.apply(opt, 3);
  EXPECT_DOUBLE_EQ(opt.lr(0), 2.0);
  EXPECT_DOUBLE_EQ(opt.lr(1), 1.0);
  EXPECT_DOUBLE_EQ(opt.initial_lr(1), 0.5);  // the schedule leaves the ratio's base alone

  // A first group made at lr 0 gives no ratio: every group follows the schedule.
  optim::SGD from_zero(std::vector<optim::ParamGroup>{{{a}, 0.0, std::nullopt}, {{b}, 0.5, std::nullopt}}, {});
  s.apply(from_zero, 3);
  EXPECT_DOUBLE_EQ(from_zero.lr(0), 2.0);
  EXPECT_DOUBLE_EQ(from_zero.lr(1), 2.0);
}

// Capturable mode needs the fused CUDA kernels: on the CPU it is refused,
// naming the reason, and the optimizer keeps working as before.
TEST(Capturable, RefusedOnTheCpuWithTheReason) {
  Generator gen(3);
  std::vector<Tensor> params{randn({4, 3}, DType::f32, kCPU, &gen).set_requires_grad(true)};
  optim::AdamW adamw(params, optim::AdamWOptions{});
  optim::SGD sgd(params, optim::SGDOptions{0.1});
  for (optim::Optimizer* opt : std::initializer_list<optim::Optimizer*>{&adamw, &sgd}) {
    const std::string msg = testing::error_of<Error>([&] { opt->set_capturable(true); });
    EXPECT_TRUE(msg.find(opt->name()) != std::string::npos &&
                (msg.find("CUDA") != std::string::npos || msg.find("fused") != std::string::npos))
        << msg;
    EXPECT_FALSE(opt->capturable());
  }
  params[0].set_grad(ones({4, 3}, DType::f32, kCPU));
  adamw.step();
  EXPECT_EQ(adamw.step_count(0), 1);
}

// A rule that counts its steps only on the host cannot be capturable, and
// says so before looking at devices.
class HostCountedRule : public optim::Optimizer {
 public:
  explicit HostCountedRule(std::vector<Tensor> params)
      : Optimizer("HostCounted", {optim::ParamGroup{std::move(params), std::nullopt, std::nullopt}}, 0.1, 0.0) {}

 protected:
  void update_group(const Group&, std::vector<optim::ParamUpdate>&) override {}
  std::vector<std::string> buffer_names() const override { return {}; }
};

TEST(Capturable, RefusedForARuleWithoutDeviceStepCounts) {
  HostCountedRule rule({zeros({2}, DType::f32, kCPU).set_requires_grad(true)});
  testing::expect_contains(testing::error_of<ValueError>([&] { rule.set_capturable(true); }),
                           {"HostCounted", "capturable mode needs a rule with device-side step counts"});
  EXPECT_FALSE(rule.capturable());
}

// On the CPU a CapturedStep runs every step eagerly and says so.
TEST(CapturedStepCpu, RunsEagerlyAndSaysWhy) {
  Generator gen(5);
  Tensor w = randn({3}, DType::f32, kCPU, &gen).set_requires_grad(true);
  optim::SGD sgd({w}, optim::SGDOptions{0.5});
  const std::vector<double> start = w.to_vector<double>();
  int calls = 0;
  CapturedStep step(kCPU, [&](const std::vector<Tensor>& in) {
    ++calls;
    sgd.zero_grad();
    backward(sum(mul(w, in[0])));
    sgd.step();
  });
  const Tensor x = full({3}, 2.0, DType::f32, kCPU);
  for (int i = 0; i < 5; ++i) step.run({x});
  EXPECT_EQ(calls, 5);
  EXPECT_FALSE(step.captured());
  EXPECT_EQ(step.replays(), 0);
  EXPECT_EQ(step.fallback_reason(), "CPU steps are not captured");
  const std::vector<double> end = w.to_vector<double>();
  for (size_t i = 0; i < end.size(); ++i) EXPECT_NEAR(end[i], start[i] - 5 * 0.5 * 2.0, 1e-5);
  testing::expect_contains(testing::error_of<ValueError>([&] { CapturedStep(kCPU, {}); }), {"no step function"});
}

// On the CPU nothing is copied ahead: each step reads the batch it was run
// on, whatever the previous run announced, and inputs_consumed() is harmless.
TEST(CapturedStepCpu, EachStepReadsItsOwnBatch) {
  Tensor w = zeros({2}, DType::f32, kCPU).set_requires_grad(true);
  optim::SGD sgd({w}, optim::SGDOptions{1.0});
  CapturedStep step(kCPU, [&](const std::vector<Tensor>& in) {
    sgd.zero_grad();
    backward(sum(mul(w, in[0])));
    CapturedStep::inputs_consumed();
    sgd.step();
  });
  CapturedStep::inputs_consumed();  // outside a step: nothing happens
  const Tensor a = from_vector(std::vector<float>{1, 2}, {2}, DType::f32);
  const Tensor b = from_vector(std::vector<float>{10, 20}, {2}, DType::f32);
  const Tensor c = from_vector(std::vector<float>{100, 200}, {2}, DType::f32);
  step.run({a}, {b});
  step.run({b}, {b});  // as announced
  step.run({c}, {a});  // not as announced
  step.run({a});
  // w -= x for each batch run: a + b + c + a.
  EXPECT_EQ(w.to_vector<double>(), (std::vector<double>{-112, -224}));
}

}  // namespace
}  // namespace mpt
