// Shape and layout ops: their gradients undo the rearrangement.
#include <algorithm>
#include <numeric>

#include "autograd/autocast_hook.h"
#include "autograd/function.h"
#include "autograd/grad_utils.h"
#include "autograd/ops.h"

namespace mpt {

Tensor detach(const Tensor& x) {
  return Tensor::view_of(x.storage(), x.shape(), x.strides(), x.offset(), x.dtype());
}

Tensor reshape(const Tensor& x, Shape shape) {
  Tensor out = prim::reshape(x, std::move(shape));
  if (needs_grad({x})) record("reshape", out, {x}, [shape = x.shape()](const Grads& g) { return Grads{prim::reshape(g[0], shape)}; });
  return out;
}

Tensor view(const Tensor& x, Shape shape) {
  Tensor out = prim::view(x, std::move(shape));
  if (needs_grad({x})) record("view", out, {x}, [shape = x.shape()](const Grads& g) { return Grads{prim::reshape(g[0], shape)}; });
  return out;
}

Tensor flatten(const Tensor& x, int64_t start_dim) {
  const int s = normalize_dim(start_dim, x.dim(), "flatten");
  // The folded size counted, not -1: with a batch of 0 the -1 could be anything.
  Shape shape(x.shape().begin(), x.shape().begin() + s);
  int64_t folded = 1;
  for (int64_t d = s; d < x.dim(); ++d) folded *= x.shape()[d];
  shape.push_back(folded);
  return reshape(x, shape);
}

Tensor transpose(const Tensor& x, int64_t d0, int64_t d1) {
  Tensor out = prim::transpose(x, d0, d1);
  if (needs_grad({x}))
    record("transpose", out, {x}, [d0, d1](const Grads& g) { return Grads{prim::transpose(g[0], d0, d1)}; });
  return out;
}

Tensor permute(const Tensor& x, const std::vector<int64_t>& dims) {
  Tensor out = prim::permute(x, dims);
  if (needs_grad({x})) {
    std::vector<int64_t> inverse(dims.size());
    for (size_t i = 0; i < dims.size(); ++i) inverse[normalize_dim(dims[i], x.dim(), "permute")] = static_cast<int64_t>(i);
    record("permute", out, {x}, [inverse](const Grads& g) { return Grads{prim::permute(g[0], inverse)}; });
  }
  return out;
}

Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step) {
  Tensor out = prim::slice(x, dim, start, end, step);
  if (needs_grad({x}))
    record("slice", out, {x}, [shape = x.shape(), dim, start, end, step](const Grads& g) {
      Tensor gx = zeros(shape, g[0].dtype(), g[0].device());
      prim::copy_(prim::slice(gx, dim, start, end, step), g[0]);
      return Grads{gx};
    });
  return out;
}

Tensor unsqueeze(const Tensor& x, int64_t dim) {
  Tensor out = prim::unsqueeze(x, dim);
  if (needs_grad({x})) record("unsqueeze", out, {x}, [shape = x.shape()](const Grads& g) { return Grads{prim::reshape(g[0], shape)}; });
  return out;
}

Tensor squeeze(const Tensor& x, int64_t dim) {
  Tensor out = prim::squeeze(x, dim);
  if (needs_grad({x})) record("squeeze", out, {x}, [shape = x.shape()](const Grads& g) { return Grads{prim::reshape(g[0], shape)}; });
  return out;
}

Tensor expand(const Tensor& x, const Shape& shape) {
  Tensor out = prim::expand(x, shape);
  if (needs_grad({x})) record("expand", out, {x}, [shape = x.shape()](const Grads& g) { return Grads{sum_to(g[0], shape)}; });
  return out;
}

Tensor contiguous(const Tensor& x) {
  Tensor out = prim::contiguous(x);
  if (needs_grad({x})) record("contiguous", out, {x}, [](const Grads& g) { return Grads{g[0]}; });
  return out;
}

Tensor cat(const std::vector<Tensor>& xs, int64_t dim) {
  if (AutocastOp ac{"cat", xs}) return cat(ac.inputs(), dim);
  Tensor out = prim::cat(xs, dim);
  if (needs_grad(xs)) {
    const int d = normalize_existing_dim(dim, xs.at(0).dim(), "cat");
    std::vector<int64_t> sizes;
    for (const Tensor& x : xs) sizes.push_back(x.shape()[d]);
    std::vector<bool> wanted;
    for (const Tensor& x : xs) wanted.push_back(x.requires_grad());
    record("cat", out, xs, [sizes, d, wanted](const Grads& g) {
      Grads gs;
      int64_t start = 0;
      for (size_t i = 0; i < sizes.size(); ++i) {
        gs.push_back(wanted[i] ? prim::slice(g[0], d, start, start + sizes[i]) : Tensor());
        start += sizes[i];
      }
      return gs;
    });
  }
  return out;
}

std::vector<Tensor> split(const Tensor& x, int64_t size, int64_t dim) {
  check<ValueError>(size > 0, "split: chunk size must be positive, got {}", size);
  const int d = normalize_existing_dim(dim, x.dim(), "split");
  std::vector<Tensor> outs;
  for (int64_t start = 0; start < x.shape()[d]; start += size) outs.push_back(prim::slice(x, d, start, start + size));
  if (needs_grad({x}))
    record("split", outs, {x}, [x = meta_of(x), d, size](const Grads& g) {
      // Chunks that already lie side by side in one block (as attention
      // writes the gradients of q | k | v): that block, without a copy.
      if (std::optional<Tensor> joined = prim::joined_slices(g, d, size, x.shape);
          joined && joined->dtype() == x.dtype && joined->device() == x.device)
        return Grads{*joined};
      // Every chunk written over (the usual case): no zeroing first.
      const bool all = std::all_of(g.begin(), g.end(), [](const Tensor& t) { return t.defined(); });
      Tensor gx = all ? Tensor::empty(x.shape, x.dtype, x.device) : zeros(x.shape, x.dtype, x.device);
      for (size_t i = 0; i < g.size(); ++i) {
        if (!g[i].defined()) continue;
        const int64_t start = static_cast<int64_t>(i) * size;
        prim::copy_(prim::slice(gx, d, start, start + size), g[i]);
      }
      return Grads{gx};
    });
  return outs;
}

Tensor to(const Tensor& x, DType dtype) { return as_cast(x, prim::to(x, dtype)); }

Tensor as_cast(const Tensor& x, Tensor cast) {
  check<ShapeError>(cast.shape() == x.shape() && cast.device() == x.device(),
                    "as_cast: {} is not a cast of {} (another shape or device)", describe(cast), describe(x));
  if (needs_grad({x}) && cast.dtype() != x.dtype())
    record(
        "to_dtype", cast, {x}, [from = x.dtype()](const Grads& g) { return Grads{prim::to(g[0], from)}; },
        FunctionNode::Saves::nothing);
  return cast;
}

Tensor to(const Tensor& x, const Device& device) {
  Tensor out = prim::to(x, device);
  if (needs_grad({x}) && device != x.device())
    record("to_device", out, {x}, [from = x.device()](const Grads& g) { return Grads{prim::to(g[0], from)}; });
  return out;
}

}  // namespace mpt
