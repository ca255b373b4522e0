// Autocast: the policy table applied per op, nesting, the weight-cast cache,
// and backward running in the dtypes forward chose.
#include <gtest/gtest.h>

#include <thread>

#include "amp/autocast.h"
#include "amp/autocast_policy.h"
#include "autograd/autocast_hook.h"
#include "autograd/engine.h"
#include "autograd/ops.h"
#include "models/layers.h"
#include "models/sgd.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

using amp::AutocastGuard;

Tensor rand_f32(const Shape& s, uint64_t seed) {
  Generator gen(seed);
  return randn(s, DType::f32, kCPU, &gen);
}

TEST(Autocast, PolicyTableFollowsPyTorchsLists) {
  using amp::CastPolicy;
  for (const char* op : {"matmul", "bmm", "linear", "conv2d", "scaled_dot_product_attention"})
    EXPECT_EQ(amp::autocast_policy(op), CastPolicy::lower_precision) << op;
  for (const char* op : {"exp", "log", "pow", "softmax", "log_softmax", "layer_norm", "mse_loss", "sum"})
    EXPECT_EQ(amp::autocast_policy(op), CastPolicy::fp32) << op;
  EXPECT_EQ(amp::autocast_policy("cat"), CastPolicy::promote);
  // Binary arithmetic promotes by itself (in PyTorch too: not in its lists).
  // mean too: it accumulates in f32 and rounds once, and PyTorch lists it nowhere.
  // cross_entropy computes in f32 whatever its logits' dtype (PyTorch casts them).
  for (const char* op : {"relu", "gelu", "reshape", "tanh", "add", "sub", "mul", "div", "mean", "cross_entropy"})
    EXPECT_EQ(amp::autocast_policy(op), CastPolicy::none) << op;
}

// cross_entropy under autocast reads 16-bit logits as they are: the loss
// and the logits' gradient are the bits of PyTorch's way, an f32 copy of the
// logits and the gradient cast back.
TEST(Autocast, CrossEntropyOf16BitLogitsIsThatOfTheirF32Copy) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Generator gen(seed);
  const Tensor target = from_vector<int64_t>({0, 4, 2, -100, 3, 1}, {6}, DType::i64);
  for (DType low : {DType::f16, DType::bf16}) {
    SCOPED_TRACE(dtype_name(low));
    Tensor logits = prim::to(prim::mul_scalar(randn({6, 5}, DType::f32, kCPU, &gen), 4.0), low);
    logits.set_requires_grad(true);
    Tensor as_is;
    {
      AutocastGuard autocast(DeviceType::cpu, low);
      as_is = cross_entropy(logits, target);
    }
    backward(as_is);
    const Tensor grad_as_is = logits.grad();
    logits.set_grad(Tensor());
    const Tensor copied = cross_entropy(to(logits, DType::f32), target);
    backward(copied);
    EXPECT_EQ(as_is.dtype(), DType::f32);
    EXPECT_EQ(grad_as_is.dtype(), low);
    EXPECT_EQ(as_is.item(), copied.item());
    EXPECT_EQ(grad_as_is.to_vector<float>(), logits.grad().to_vector<float>());
  }
}

TEST(Autocast, OutputDtypesPerOpCategory) {
  for (DType low : {DType::f16, DType::bf16}) {
    SCOPED_TRACE(dtype_name(low));
    const Tensor x = rand_f32({4, 8}, 1), w = rand_f32({3, 8}, 2), b = rand_f32({3}, 3);
    const Tensor x16 = prim::to(x, DType::f16);
    AutocastGuard autocast(DeviceType::cpu, low);
    // lower precision
    EXPECT_EQ(linear(x, w, b).dtype(), low);
    EXPECT_EQ(matmul(x, transpose(w, 0, 1)).dtype(), low);
    EXPECT_EQ(bmm(reshape(x, {1, 4, 8}), reshape(transpose(w, 0, 1), {1, 8, 3})).dtype(), low);
    const Tensor img = rand_f32({1, 2, 5, 5}, 4), k = rand_f32({3, 2, 3, 3}, 5);
    EXPECT_EQ(conv2d(img, k).dtype(), low);
    const Tensor q = rand_f32({1, 2, 4, 8}, 6);
    EXPECT_EQ(scaled_dot_product_attention(q, q, q).dtype(), low);
    // f32
    EXPECT_EQ(exp(x16).dtype(), DType::f32);
    EXPECT_EQ(log(exp(x16)).dtype(), DType::f32);
    EXPECT_EQ(pow(x16, 2.0).dtype(), DType::f32);
    EXPECT_EQ(softmax(x16, 1).dtype(), DType::f32);
    EXPECT_EQ(log_softmax(x16, 1).dtype(), DType::f32);
    EXPECT_EQ(layer_norm(x16, Tensor(), Tensor()).dtype(), DType::f32);
    EXPECT_EQ(sum(x16).dtype(), DType::f32);
    EXPECT_EQ(mean(x16).dtype(), DType::f16);  // left alone
    EXPECT_EQ(mse_loss(x16, x16).dtype(), DType::f32);
    const Tensor target = from_vector<int64_t>({0, 1, 2, 0}, {4}, DType::i64);
    EXPECT_EQ(cross_entropy(linear(x, w, b), target).dtype(), DType::f32);
    // promote to the widest input
    EXPECT_EQ(add(x16, x).dtype(), DType::f32);
    EXPECT_EQ(mul(x, x16).dtype(), DType::f32);
    EXPECT_EQ(sub(x16, x).dtype(), DType::f32);
    EXPECT_EQ(div(x, x16).dtype(), DType::f32);
    EXPECT_EQ(pow(x16, x).dtype(), DType::f32);
    EXPECT_EQ(cat({x16, x}, 0).dtype(), DType::f32);
    EXPECT_EQ(add(x16, x16).dtype(), DType::f16);
    // untouched
    EXPECT_EQ(relu(x).dtype(), DType::f32);
    EXPECT_EQ(relu(x16).dtype(), DType::f16);
    // f64 (gradient checks) is never lowered
    EXPECT_EQ(matmul(prim::to(x, DType::f64), prim::to(transpose(w, 0, 1), DType::f64)).dtype(), DType::f64);
  }
}

TEST(Autocast, ValuesAreTheOpOnCastInputs) {
  const Tensor x = rand_f32({4, 8}, 7), w = rand_f32({3, 8}, 8);
  Tensor expected = prim::matmul(prim::to(x, DType::f16), prim::transpose(prim::to(w, DType::f16), 0, 1));
  AutocastGuard autocast(DeviceType::cpu, DType::f16);
  EXPECT_EQ(linear(x, w).to_vector<float>(), expected.to_vector<float>());
}

// Without a dtype, each device type takes PyTorch's: bf16 on the CPU, f16 on CUDA.
TEST(Autocast, EachDeviceTypeHasItsUsualDtype) {
  {
    AutocastGuard on_cpu(DeviceType::cpu);
    EXPECT_EQ(amp::autocast_dtype(DeviceType::cpu), DType::bf16);
    EXPECT_EQ(linear(rand_f32({4, 8}, 9), rand_f32({3, 8}, 10)).dtype(), DType::bf16);
  }
  AutocastGuard on_cuda(DeviceType::cuda);
  EXPECT_EQ(amp::autocast_dtype(DeviceType::cuda), DType::f16);
}

TEST(Autocast, GuardsNestAndRestore) {
  const Tensor x = rand_f32({2, 3}, 9), w = rand_f32({3, 3}, 10);
  EXPECT_FALSE(amp::autocast_enabled(DeviceType::cpu));
  {
    AutocastGuard outer(DeviceType::cpu, DType::f16);
    EXPECT_EQ(linear(x, w).dtype(), DType::f16);
    {
      AutocastGuard off(DeviceType::cpu, DType::f16, false);
      EXPECT_EQ(linear(x, w).dtype(), DType::f32);
      {
        AutocastGuard inner(DeviceType::cpu, DType::bf16);
        EXPECT_EQ(linear(x, w).dtype(), DType::bf16);
      }
      EXPECT_EQ(linear(x, w).dtype(), DType::f32);
    }
    EXPECT_EQ(linear(x, w).dtype(), DType::f16);
  }
  EXPECT_FALSE(amp::autocast_enabled(DeviceType::cpu));
  EXPECT_EQ(linear(x, w).dtype(), DType::f32);
}

TEST(Autocast, OtherDeviceTypeIsLeftAlone) {
  const Tensor x = rand_f32({2, 3}, 11), w = rand_f32({3, 3}, 12);
  AutocastGuard autocast(DeviceType::cuda, DType::f16);
  EXPECT_EQ(linear(x, w).dtype(), DType::f32);  // CPU tensors: CPU autocast is off
}

// What a producer asks before writing its result for a consumer op: the
// dtype the consumer's cast would give, per policy, and the input's own
// where autocast is off, suspended, on another device or leaves it alone.
TEST(Autocast, InputDtypeIsWhatTheConsumersCastWouldGive) {
  const Tensor x = rand_f32({2, 3}, 13), x16 = prim::to(x, DType::f16), x64 = prim::to(x, DType::f64);
  const Tensor gpu_like = rand_f32({2}, 14);
  EXPECT_EQ(autocast_input_dtype("linear", x), DType::f32);  // off
  for (DType low : {DType::f16, DType::bf16}) {
    AutocastGuard autocast(DeviceType::cpu, low);
    EXPECT_EQ(autocast_input_dtype("linear", x), low);
    EXPECT_EQ(autocast_input_dtype("conv2d", x16), low);
    EXPECT_EQ(autocast_input_dtype("layer_norm", x16), DType::f32);
    EXPECT_EQ(autocast_input_dtype("add", x16), DType::f16);
    EXPECT_EQ(autocast_input_dtype("relu", x), DType::f32);
    EXPECT_EQ(autocast_input_dtype("linear", x64), DType::f64);  // f64 is never lowered
    {
      AutocastSuspendGuard suspended;
      EXPECT_EQ(autocast_input_dtype("linear", x), DType::f32);
    }
    // As cast_inputs does it: the same dtype as the linear's own cast.
    EXPECT_EQ(autocast_input_dtype("linear", x), linear(x, rand_f32({4, 3}, 15)).dtype());
  }
  AutocastGuard cuda_only(DeviceType::cuda, DType::f16);
  EXPECT_EQ(autocast_input_dtype("linear", gpu_like), DType::f32);  // a CPU tensor
}

// A cached cast serves only while its weight is unchanged: after an
// optimizer step inside the region, the next forward pass casts the new
// weights instead of using the cast of the old ones.
TEST(Autocast, AnOptimizerStepInsideARegionMakesTheCachedCastsStale) {
  Tensor w = rand_f32({3, 8}, 16).set_requires_grad(true);
  const Tensor x = rand_f32({4, 8}, 17);
  optim::SGD sgd({w}, optim::SGDOptions{.lr = 0.5});
  AutocastGuard autocast(DeviceType::cpu);
  backward(sum(linear(x, w)));
  sgd.step();
  const int64_t misses = amp::weight_cast_cache_stats().misses;
  const Tensor after = linear(x, w);
  EXPECT_EQ(amp::weight_cast_cache_stats().misses, misses + 1);  // cast again
  AutocastGuard fresh_cast(DeviceType::cpu);
  amp::clear_weight_cast_cache();
  EXPECT_EQ(after.to_vector<float>(), linear(x, w).to_vector<float>());
}

// So does a module's load_state_dict: the loaded values serve the next pass.
TEST(Autocast, LoadingAModuleInsideARegionMakesTheCachedCastsStale) {
  Generator gen(18);
  nn::Linear layer(8, 3, false, &gen), other(8, 3, false, &gen);
  const Tensor x = rand_f32({4, 8}, 19);
  AutocastGuard autocast(DeviceType::cpu);
  amp::cast_weights_ahead(layer.parameters());
  layer.forward(x);
  layer.load_state_dict(other.state_dict());
  EXPECT_EQ(layer.forward(x).to_vector<float>(), other.forward(x).to_vector<float>());
}

// And any other write into the weight through the tensor API (an EMA, a
// copy from elsewhere), which no optimizer or module method sees.
TEST(Autocast, AnInPlaceWriteToAWeightMakesItsCachedCastStale) {
  Tensor w = rand_f32({3, 8}, 20).set_requires_grad(true);
  const Tensor w_new = rand_f32({3, 8}, 21);
  const Tensor x = rand_f32({4, 8}, 22);
  Tensor expected;
  {
    AutocastGuard autocast(DeviceType::cpu);
    expected = linear(x, w_new);
  }
  AutocastGuard autocast(DeviceType::cpu);
  const Tensor before = linear(x, w);
  EXPECT_EQ(linear(x, w).to_vector<float>(), before.to_vector<float>());  // served from the cache
  prim::copy_(w, w_new);
  EXPECT_EQ(linear(x, w).to_vector<float>(), expected.to_vector<float>());
  EXPECT_EQ(amp::weight_cast_cache_stats().entries, 1);  // the stale cast was replaced, not kept beside
}

TEST(Autocast, RejectsNonHalfDtype) { EXPECT_THROW(AutocastGuard(DeviceType::cpu, DType::f32), DTypeError); }

TEST(Autocast, WeightCastCacheIsHitWithinTheOutermostRegion) {
  Tensor w = rand_f32({4, 4}, 13).set_requires_grad(true);
  const Tensor x = rand_f32({2, 4}, 14);
  const auto before = amp::weight_cast_cache_stats();
  {
    AutocastGuard autocast(DeviceType::cpu);
    Tensor h = linear(x, w);
    {
      AutocastGuard inner(DeviceType::cpu);  // nested regions share the cache
      h = linear(h, w);
    }
    h = linear(h, w);
    const auto during = amp::weight_cast_cache_stats();
    EXPECT_EQ(during.misses - before.misses, 1);  // cast once ...
    EXPECT_EQ(during.hits - before.hits, 2);      // ... used three times
    EXPECT_EQ(during.entries, 1);
    // Inputs that are not leaf weights are never cached.
    linear(x, rand_f32({4, 4}, 15));
    EXPECT_EQ(amp::weight_cast_cache_stats().entries, 1);
  }
  EXPECT_EQ(amp::weight_cast_cache_stats().entries, 0);  // the outermost region cleared it
  {
    AutocastGuard autocast(DeviceType::cpu);
    linear(x, w);
    EXPECT_EQ(amp::weight_cast_cache_stats().misses - before.misses, 2);  // a new region casts afresh
  }
}

// Weights cast ahead (one block for all, one copy call) are the casts the
// ops would make: the region's ops hit the cache instead of casting, and
// the output and every gradient are the same bits as with casts made one at
// a time. What the region would not cache (a tensor that needs no gradient,
// an f64 leaf) is left alone, and so is a weight of 4Mi elements.
TEST(Autocast, WeightsCastAheadAreTheOpsOwnCastsBitForBit) {
  auto run = [](bool ahead) {
    std::vector<Tensor> w;
    for (uint64_t seed : {31, 32, 33}) w.push_back(rand_f32({8, 8}, seed).set_requires_grad(true));
    const Tensor b = rand_f32({8}, 34).set_requires_grad(true);
    const Tensor frozen = rand_f32({8, 8}, 35);
    Tensor wide = prim::to(rand_f32({8, 8}, 36), DType::f64);
    wide.set_requires_grad(true);
    const Tensor x = rand_f32({5, 8}, 37);
    Tensor h = x;
    amp::WeightCastCacheStats during;
    const auto before = amp::weight_cast_cache_stats();
    {
      AutocastGuard autocast(DeviceType::cpu, DType::bf16);
      if (ahead) {
        Tensor big = zeros({int64_t(1) << 22}, DType::f32);  // left to its op (its launch costs nothing next to its bytes)
        big.set_requires_grad(true);
        amp::cast_weights_ahead({w[0], w[1], w[2], b, frozen, wide, big});
        EXPECT_EQ(amp::weight_cast_cache_stats().entries, 4);  // the three weights and the bias
      }
      for (const Tensor& t : w) h = relu(linear(h, t, b));
      h = linear(h, frozen);
      during = amp::weight_cast_cache_stats();
    }
    EXPECT_EQ(during.misses - before.misses, 4);
    EXPECT_EQ(during.hits - before.hits, ahead ? 6 : 2);  // every use of a weight or the bias once cast
    backward(sum(to(h, DType::f32)));
    std::vector<std::vector<double>> out{h.to_vector<double>(), b.grad().to_vector<double>()};
    for (const Tensor& t : w) out.push_back(t.grad().to_vector<double>());
    return out;
  };
  EXPECT_EQ(run(true), run(false));
}

// Gradient accumulation inside one region: both forwards use the one cached
// cast of w, so both backward passes run through its cast node, and w's
// gradient is the sum of what each pass gives on its own.
TEST(Autocast, TwoBackwardPassesThroughTheCachedCastAccumulate) {
  Tensor w = rand_f32({4, 4}, 21).set_requires_grad(true);
  const Tensor a = rand_f32({2, 4}, 22), b = rand_f32({3, 4}, 23);
  std::vector<float> expected(16, 0.0f);
  for (const Tensor& x : {a, b}) {
    AutocastGuard autocast(DeviceType::cpu);  // a region of its own: a fresh cast
    w.set_grad(Tensor());
    backward(sum(linear(x, w)));
    const auto g = w.grad().to_vector<float>();
    for (size_t i = 0; i < g.size(); ++i) expected[i] += g[i];
  }
  w.set_grad(Tensor());
  {
    AutocastGuard autocast(DeviceType::cpu);
    backward(sum(linear(a, w)));
    backward(sum(linear(b, w)));
    EXPECT_EQ(amp::weight_cast_cache_stats().entries, 1);  // one cast served both
  }
  EXPECT_EQ(w.grad().to_vector<float>(), expected);
}

TEST(Autocast, NoCachingUnderNoGrad) {
  Tensor w = rand_f32({4, 4}, 16).set_requires_grad(true);
  const Tensor x = rand_f32({2, 4}, 17);
  AutocastGuard autocast(DeviceType::cpu);
  {
    NoGradGuard no_grad;
    linear(x, w);
  }
  EXPECT_EQ(amp::weight_cast_cache_stats().entries, 0);
  // The recorded use afterwards still reaches the weight.
  backward(sum(linear(x, w)));
  EXPECT_TRUE(w.grad().defined());
}

TEST(Autocast, BackwardRunsInForwardsDtypesAndMasterWeightsGetF32Grads) {
  Tensor w = rand_f32({3, 5}, 18).set_requires_grad(true);
  Tensor x = rand_f32({4, 5}, 19).set_requires_grad(true);
  const Tensor g = rand_f32({4, 3}, 20);
  Tensor y;
  {
    AutocastGuard autocast(DeviceType::cpu, DType::f16);
    y = linear(x, w);
  }
  ASSERT_EQ(y.dtype(), DType::f16);
  backward(y, prim::to(g, DType::f16));
  ASSERT_EQ(w.grad().dtype(), DType::f32);
  ASSERT_EQ(x.grad().dtype(), DType::f32);
  // The rule: the f16 linear's gradients, computed in f16, then widened.
  const Tensor g16 = prim::to(g, DType::f16), x16 = prim::to(x, DType::f16), w16 = prim::to(w, DType::f16);
  EXPECT_EQ(w.grad().to_vector<float>(), prim::to(prim::matmul(prim::transpose(g16, 0, 1), x16), DType::f32).to_vector<float>());
  EXPECT_EQ(x.grad().to_vector<float>(), prim::to(prim::matmul(g16, w16), DType::f32).to_vector<float>());
}

TEST(Autocast, FP32OpBackwardReturnsToTheInputDtype) {
  Tensor x = prim::to(rand_f32({3, 4}, 21), DType::f16).set_requires_grad(true);
  {
    AutocastGuard autocast(DeviceType::cpu);
    backward(sum(softmax(x, 1) * rand_f32({3, 4}, 22)));
  }
  EXPECT_EQ(x.grad().dtype(), DType::f16);
}

}  // namespace
}  // namespace mpt

namespace mpt {
namespace {

TEST(Autocast, StateIsPerThreadAndCarriesIntoWorkers) {
  const Tensor x = rand_f32({2, 3}, 23), w = rand_f32({3, 3}, 24);
  amp::AutocastGuard autocast(DeviceType::cpu, DType::bf16);
  const amp::AutocastSettings settings = amp::current_autocast_settings();
  DType plain = DType::u8, carried = DType::u8;
  std::thread worker([&] {
    plain = linear(x, w).dtype();  // a new thread starts with autocast off
    amp::AutocastSettingsGuard guard(settings);
    carried = linear(x, w).dtype();
  });
  worker.join();
  EXPECT_EQ(plain, DType::f32);
  EXPECT_EQ(carried, DType::bf16);
}

}  // namespace
}  // namespace mpt
