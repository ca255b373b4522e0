#pragma once
// Small models for the data-parallel tests: seeded, so two processes (or a
// process and its reference) build identical ones.
#include <memory>
#include <vector>

#include "models/layers.h"
#include "models/sequential.h"
#include "tensor/ops.h"
#include "tensor/random.h"

namespace mpt::testing {

// Every parameter's values, one after the other (to compare two models).
inline std::vector<double> flat_parameters(nn::Module& m) {
  std::vector<double> out;
  for (auto& p : m.parameters())
    for (double v : p.to_vector<double>()) out.push_back(v);
  return out;
}

// `steps` batches of `batch` rows for make_mlp's models: inputs of 6
// features and regression targets of 3, drawn from `seed`.
struct MlpBatches {
  MlpBatches(int steps, int64_t batch, uint64_t seed) : batch(batch) {
    Generator data(seed);
    X = randn({steps * batch, 6}, DType::f32, kCPU, &data);
    Y = randn({steps * batch, 3}, DType::f32, kCPU, &data);
  }
  Tensor x(int step) const { return prim::slice(X, 0, step * batch, (step + 1) * batch); }
  Tensor y(int step) const { return prim::slice(Y, 0, step * batch, (step + 1) * batch); }

  int64_t batch;
  Tensor X, Y;
};

inline std::shared_ptr<nn::Sequential> make_mlp(uint64_t seed) {
  Generator gen(seed);
  auto m = std::make_shared<nn::Sequential>();
  m->push_back(std::make_shared<nn::Linear>(6, 24, true, &gen));
  m->push_back(std::make_shared<nn::ReLU>());
  m->push_back(std::make_shared<nn::Linear>(24, 16, true, &gen));
  m->push_back(std::make_shared<nn::ReLU>());
  m->push_back(std::make_shared<nn::Linear>(16, 3, true, &gen));
  return m;
}

// Two heads, of which forward uses only the first: `spare` never gets a
// gradient.
class WithSpareHead : public nn::Module {
 public:
  explicit WithSpareHead(uint64_t seed) : Module("WithSpareHead") {
    Generator gen(seed);
    used = register_module("used", std::make_shared<nn::Linear>(6, 3, true, &gen));
    spare = register_module("spare", std::make_shared<nn::Linear>(6, 3, true, &gen));
  }
  Tensor forward(const Tensor& x) override { return used->forward(x); }
  std::shared_ptr<nn::Linear> used, spare;
};

// A linear layer whose forward keeps a running mean of its inputs in a
// buffer, as a batch norm keeps its statistics, and notes the value the
// buffer had when the forward began.
class WithRunningMean : public nn::Module {
 public:
  explicit WithRunningMean(uint64_t seed) : Module("WithRunningMean") {
    Generator gen(seed);
    linear = register_module("linear", std::make_shared<nn::Linear>(6, 3, true, &gen));
    running_mean = register_buffer("running_mean", zeros({1}));
  }
  Tensor forward(const Tensor& x) override {
    seen = prim::clone(running_mean);
    prim::copy_(running_mean, prim::add(prim::mul_scalar(running_mean, 0.5),
                                        prim::mul_scalar(prim::reshape(prim::mean(x), {1}), 0.5)));
    return linear->forward(x);
  }
  std::shared_ptr<nn::Linear> linear;
  Tensor running_mean, seen;
};

}  // namespace mpt::testing
