#include "parallel/bucket.h"

#include "parallel/bucket_cuda.h"
#include "tensor/ops.h"

namespace mpt::dist {

std::vector<std::vector<size_t>> assign_buckets(const std::vector<size_t>& order, const std::vector<size_t>& bytes,
                                                size_t first_cap, size_t cap) {
  check<ValueError>(first_cap > 0 && cap > 0, "assign_buckets: bucket caps must be positive (got {} and {})",
                    first_cap, cap);
  std::vector<std::vector<size_t>> buckets;
  std::vector<size_t> current;
  size_t filled = 0;
  auto close = [&] {
    buckets.push_back(std::move(current));
    current.clear();
    filled = 0;
  };
  for (size_t index : order) {
    check<ValueError>(index < bytes.size(), "assign_buckets: parameter index {} outside 0..{}", index,
                      bytes.size() - 1);
    const bool alone = bytes[index] >= cap;
    if (alone && !current.empty()) close();
    current.push_back(index);
    filled += bytes[index];
    if (alone || filled >= (buckets.empty() ? first_cap : cap)) close();
  }
  if (!current.empty()) buckets.push_back(std::move(current));
  return buckets;
}

void fill_slots(const std::vector<Tensor>& slots, const std::vector<Tensor>& grads, double scale) {
  check(slots.size() == grads.size(), "fill_slots: {} slots for {} gradients", slots.size(), grads.size());
  if (slots.empty()) return;
  // One launch takes the pairs of the first pair's two dtypes (a bucket's
  // gradients share one, and its slots another).
  const DType slot_dtype = slots.front().dtype(), grad_dtype = grads.front().dtype();
  auto batchable = [](DType d) { return d == DType::f32 || d == DType::f16 || d == DType::bf16; };
  std::vector<Tensor> batched_slots, batched_grads;
  for (size_t i = 0; i < slots.size(); ++i) {
    const Tensor &slot = slots[i], &g = grads[i];
    check<ShapeError>(slot.shape() == g.shape(), "fill_slots: gradient {} does not fit its slot {}", describe(g),
                      describe(slot));
    const bool batched = slot.device().is_cuda() && g.device() == slot.device() && slot.dtype() == slot_dtype &&
                         g.dtype() == grad_dtype && batchable(slot_dtype) && batchable(grad_dtype) &&
                         g.is_contiguous() && slot.is_contiguous();
    if (batched) {
      batched_slots.push_back(slot);
      batched_grads.push_back(g);
    } else if (g.dtype() == slot.dtype()) {
      prim::unary_(UnaryOp::affine, slot, g, scale, 0.0);
    } else {
      // As the kernel does: scaled in f32 (f64 if either side is), rounded once.
      const DType wide = g.dtype() == DType::f64 || slot.dtype() == DType::f64 ? DType::f64 : DType::f32;
      prim::copy_(slot, prim::unary(UnaryOp::affine, prim::to(g, wide), scale, 0.0));
    }
  }
  if (!batched_slots.empty()) cuda::scaled_copy_list(batched_slots, batched_grads, scale);
}

}  // namespace mpt::dist
