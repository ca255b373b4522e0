#pragma once
// Sequential: the simplest container, a chain of single-input modules.
#include <memory>
#include <string>
#include <vector>

#include "models/module.h"

namespace mpt::nn {

// Chains single-input modules; children are named "0", "1", ... A Linear
// followed by a ReLU (those exact types) runs as one op, linear_relu: what
// the two compute one after the other, with the ReLU in the GEMM's epilogue
// on CUDA (one pass over the activations less in forward, and the product
// before the ReLU never stored).
class Sequential : public Module {
 public:
  Sequential() : Module("Sequential") {}
  Sequential(std::initializer_list<std::shared_ptr<Module>> modules);

  template <typename M>
  std::shared_ptr<M> push_back(std::shared_ptr<M> module) {
    register_module(std::to_string(layers_.size()), module);
    layers_.push_back(module);
    return module;
  }
  Tensor forward(const Tensor& x) override;

  size_t size() const { return layers_.size(); }
  const std::shared_ptr<Module>& operator[](size_t i) const { return layers_.at(i); }

 private:
  std::vector<std::shared_ptr<Module>> layers_;
};

}  // namespace mpt::nn
