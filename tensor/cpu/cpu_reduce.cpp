// Reductions over the middle axis of a contiguous [outer, k, inner] block.
// Floating inputs accumulate in f32 (f64 for f64), like the GPU kernels.
#include <limits>
#include <vector>

#include "tensor/cpu/cpu_kernels.h"

namespace mpt::cpu {
namespace {

template <typename T>
void reduce_typed(ReduceOp op, const TensorView& out, const TensorView& in, int64_t outer, int64_t k, int64_t inner) {
  using C = typename ComputeType<T>::type;
  const T* x = static_cast<const T*>(in.data);
  std::vector<C> acc(static_cast<size_t>(inner));
  std::vector<int64_t> arg(op == ReduceOp::argmax ? static_cast<size_t>(inner) : 0);
  for (int64_t o = 0; o < outer; ++o) {
    const T* block = x + o * k * inner;
    for (int64_t i = 0; i < inner; ++i) acc[i] = load<T, C>(block + i);
    if (op == ReduceOp::argmax) std::fill(arg.begin(), arg.end(), 0);
    // Walk k in the outer loop so that `inner` reads stay contiguous.
    for (int64_t j = 1; j < k; ++j) {
      const T* row = block + j * inner;
      for (int64_t i = 0; i < inner; ++i) {
        const C v = load<T, C>(row + i);
        C& a = acc[i];
        switch (op) {
          case ReduceOp::sum:
          case ReduceOp::mean: a += v; break;
          // NaN wins, as in torch.amax / torch.argmax.
          case ReduceOp::max: if (a == a && (v > a || v != v)) a = v; break;
          case ReduceOp::min: if (a == a && (v < a || v != v)) a = v; break;
          case ReduceOp::argmax:
            if (a == a && (v > a || v != v)) {
              a = v;
              arg[i] = j;
            }
            break;
        }
      }
    }
    if (op == ReduceOp::argmax) {
      int64_t* dst = static_cast<int64_t*>(out.data) + o * inner;
      for (int64_t i = 0; i < inner; ++i) dst[i] = arg[i];
    } else {
      T* dst = static_cast<T*>(out.data) + o * inner;
      const C scale = op == ReduceOp::mean ? static_cast<C>(1) / static_cast<C>(k) : static_cast<C>(1);
      for (int64_t i = 0; i < inner; ++i) store<T, C>(dst + i, op == ReduceOp::mean ? acc[i] * scale : acc[i]);
    }
  }
}

}  // namespace

void reduce(ReduceOp op, const TensorView& out, const TensorView& in, int64_t outer, int64_t k, int64_t inner) {
  dispatch_float(in.dtype, reduce_op_name(op), [&](auto tag) { reduce_typed<decltype(tag)>(op, out, in, outer, k, inner); });
}

}  // namespace mpt::cpu
