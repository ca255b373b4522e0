#pragma once
// The gradients data parallelism over equal shards must produce, computed on
// one device: each shard's scaled mean loss (mse, as the tests' regressions
// use) is differentiated on its own and the gradients are averaged. Under
// f16 autocast this, not one backward over the whole batch, is the exact
// reference: a weight gradient is a sum over rows rounded to f16, and a
// shard rounds its partial sum before the average adds it to the others.
// (Halving is exact, so the order of the scaling and the sum does not
// matter.)
#include <vector>

#include "amp/grad_scaler.h"
#include "autograd/engine.h"
#include "autograd/ops.h"
#include "models/module.h"
#include "tensor/ops.h"

namespace mpt::testing {

inline void backward_averaged_over_shards(nn::Module& model, amp::GradScaler& scaler, const Tensor& x,
                                          const Tensor& y, int64_t shards) {
  auto params = model.parameters();
  std::vector<Tensor> sums(params.size());
  const int64_t rows = x.size(0) / shards;
  for (int64_t s = 0; s < shards; ++s) {
    for (auto& p : params) p.set_grad(Tensor());
    const Tensor xs = prim::slice(x, 0, s * rows, (s + 1) * rows), ys = prim::slice(y, 0, s * rows, (s + 1) * rows);
    backward(scaler.scale(mse_loss(model.forward(xs), ys)));
    for (size_t k = 0; k < params.size(); ++k)
      sums[k] = sums[k].defined() ? prim::add(sums[k], params[k].grad()) : params[k].grad();
  }
  for (size_t k = 0; k < params.size(); ++k) params[k].set_grad(prim::mul_scalar(sums[k], 1.0 / static_cast<double>(shards)));
}

}  // namespace mpt::testing
