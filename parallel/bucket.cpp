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
  // One launch takes pairs of one dtype: a bucket's (the first slot's).
  std::vector<Tensor> batched_slots, batched_grads;
  for (size_t i = 0; i < slots.size(); ++i) {
    const Tensor &slot = slots[i], &g = grads[i];
    check<ShapeError>(slot.shape() == g.shape(), "fill_slots: gradient {} does not fit its slot {}", describe(g),
                      describe(slot));
    const DType dtype = slot.dtype();
    const bool batched = slot.device().is_cuda() && g.device() == slot.device() && g.dtype() == dtype &&
                         dtype == slots.front().dtype() && g.is_contiguous() && slot.is_contiguous() &&
                         (dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16);
    if (batched) {
      batched_slots.push_back(slot);
      batched_grads.push_back(g);
    } else {
      prim::unary_(UnaryOp::affine, slot, g, scale, 0.0);
    }
  }
  if (!batched_slots.empty()) cuda::scaled_copy_list(batched_slots, batched_grads, scale);
}

}  // namespace mpt::dist
