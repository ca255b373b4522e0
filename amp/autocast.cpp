#include "amp/autocast.h"

#include <unordered_map>
#include <vector>

#include "amp/autocast_policy.h"
#include "autograd/autocast_hook.h"
#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "tensor/ops.h"

namespace mpt::amp {
namespace {

constexpr int kDeviceTypes = 2;
int slot(DeviceType t) { return t == DeviceType::cuda ? 1 : 0; }

// Autocast only re-types the training dtypes; f64 (gradient checks) and
// integers pass through untouched, as in PyTorch.
bool eligible(const Tensor& t) {
  return t.defined() && (t.dtype() == DType::f32 || t.dtype() == DType::f16 || t.dtype() == DType::bf16);
}

// The inputs the promote policy widens to the widest of them. Float8 stays
// as it is, for the op to refuse by name: it promotes with nothing.
bool promotable(const Tensor& t) { return t.defined() && is_floating(t.dtype()) && !is_float8(t.dtype()); }

// A cast serves while its weight keeps the storage and the version it had
// when cast: an optimizer step, load_state_dict(), a copy_ into the weight
// or a move to another device (a new storage) makes it stale.
struct CachedCast {
  std::shared_ptr<TensorImpl> leaf;  // held so its address cannot be reused while cached
  std::shared_ptr<Storage> storage;  // the same, for the storage it was cast from
  uint64_t version;
  DType dtype;
  Tensor cast;

  CachedCast(const Tensor& weight, Tensor cast_of_it)
      : leaf(weight.impl_ptr()), storage(weight.storage()), version(weight.version()), dtype(cast_of_it.dtype()),
        cast(std::move(cast_of_it)) {}
  bool current() const { return leaf->storage == storage && storage->version() == version; }
};

class PolicyHandler final : public AutocastHandler {
 public:
  bool enabled[kDeviceTypes] = {false, false};
  DType dtype[kDeviceTypes] = {DType::f16, DType::f16};
  int nesting = 0;
  std::unordered_multimap<const TensorImpl*, CachedCast> cache;
  WeightCastCacheStats stats;

  bool any_enabled() const { return enabled[0] || enabled[1]; }

  std::vector<Tensor> cast_inputs(const char* op, const std::vector<Tensor>& inputs) override {
    const CastPolicy policy = autocast_policy(op);
    if (policy == CastPolicy::none) return inputs;
    const Tensor* first = nullptr;
    for (const Tensor& t : inputs)
      if (promotable(t)) {
        first = &t;
        break;
      }
    if (!first || !enabled[slot(first->device().type)]) return inputs;

    std::vector<Tensor> out = inputs;
    switch (policy) {
      case CastPolicy::lower_precision: {
        const DType target = dtype[slot(first->device().type)];
        for (Tensor& t : out)
          if (eligible(t) && t.dtype() != target) t = cast_weight_cached(t, target);
        break;
      }
      case CastPolicy::fp32:
        for (Tensor& t : out)
          if (eligible(t) && t.dtype() != DType::f32) t = to(t, DType::f32);
        break;
      case CastPolicy::promote: {
        DType widest = first->dtype();
        for (const Tensor& t : out)
          if (promotable(t)) widest = promote(widest, t.dtype());
        for (Tensor& t : out)
          if (promotable(t) && t.dtype() != widest) t = to(t, widest);
        break;
      }
      case CastPolicy::none: break;
    }
    return out;
  }

  DType input_dtype(const char* op, const Tensor& x) override {
    if (!eligible(x) || !enabled[slot(x.device().type)]) return x.dtype();
    switch (autocast_policy(op)) {
      case CastPolicy::lower_precision: return dtype[slot(x.device().type)];
      case CastPolicy::fp32: return DType::f32;
      case CastPolicy::promote:
      case CastPolicy::none: break;
    }
    return x.dtype();
  }

  // Casts every cacheable weight of `weights` not cached yet, one launch
  // per device (see cast_weights_ahead). A weight of kCastAheadMaxElements
  // or more is left to its op: its launch costs nothing next to its bytes,
  // and the op's own cast moves them faster.
  static constexpr int64_t kCastAheadMaxElements = int64_t(1) << 22;
  void cast_ahead(const std::vector<Tensor>& weights) {
    std::vector<Tensor> pending;
    for (const Tensor& w : weights)
      if (cacheable(w) && w.numel() < kCastAheadMaxElements && enabled[slot(w.device().type)] &&
          !cached(w, dtype[slot(w.device().type)]))
        pending.push_back(w);
    while (!pending.empty()) {
      const Device device = pending.front().device();
      const DType target = dtype[slot(device.type)];
      std::vector<Tensor> here, rest;
      for (Tensor& w : pending) (w.device() == device ? here : rest).push_back(std::move(w));
      // One block for all of them, each slot starting on a 16-byte boundary.
      constexpr int64_t kAlign = 8;
      std::vector<int64_t> offsets;
      int64_t total = 0;
      for (const Tensor& w : here) {
        offsets.push_back(total);
        total += (w.numel() + kAlign - 1) / kAlign * kAlign;
      }
      const Tensor block = Tensor::empty({total}, target, device);
      std::vector<Tensor> slots;
      for (size_t i = 0; i < here.size(); ++i)
        slots.push_back(prim::view(prim::slice(block, 0, offsets[i], offsets[i] + here[i].numel()), here[i].shape()));
      prim::scaled_copy_list_(slots, here, 1.0);
      for (size_t i = 0; i < here.size(); ++i) {
        cache.emplace(here[i].impl_ptr().get(), CachedCast(here[i], as_cast(here[i], slots[i])));
        ++stats.misses;
      }
      pending = std::move(rest);
    }
  }

 private:
  // PyTorch's rule: only f32 leaves that require a gradient (weights) are
  // cached, and only while recording, so a cast made under no_grad (which
  // has no path back to the weight) is never reused by a training step.
  static bool cacheable(const Tensor& t) {
    return t.defined() && t.dtype() == DType::f32 && t.requires_grad() && !t.grad_fn() && grad_enabled();
  }
  // The current cast of t to target, if cached; a stale one is dropped.
  const Tensor* cached(const Tensor& t, DType target) {
    auto [begin, end] = cache.equal_range(t.impl_ptr().get());
    for (auto it = begin; it != end; ++it) {
      if (it->second.dtype != target) continue;
      if (it->second.current()) return &it->second.cast;
      cache.erase(it);
      return nullptr;
    }
    return nullptr;
  }
  Tensor cast_weight_cached(const Tensor& t, DType target) {
    if (!cacheable(t)) return to(t, target);
    if (const Tensor* hit = cached(t, target)) {
      ++stats.hits;
      return *hit;
    }
    Tensor cast = to(t, target);
    cache.emplace(t.impl_ptr().get(), CachedCast(t, cast));
    ++stats.misses;
    return cast;
  }
};

thread_local PolicyHandler t_policy;

void install_if_enabled() { set_autocast_handler(t_policy.any_enabled() ? &t_policy : nullptr); }

}  // namespace

AutocastGuard::AutocastGuard(DeviceType device_type)
    : AutocastGuard(device_type, device_type == DeviceType::cpu ? DType::bf16 : DType::f16) {}

AutocastGuard::AutocastGuard(DeviceType device_type, DType dtype, bool enabled)
    : device_type_(device_type),
      previous_enabled_(t_policy.enabled[slot(device_type)]),
      previous_dtype_(t_policy.dtype[slot(device_type)]) {
  check<DTypeError>(dtype == DType::f16 || dtype == DType::bf16,
                    "AutocastGuard: the autocast dtype for {} must be f16 or bf16, got {}",
                    Device(device_type).str(), dtype_name(dtype));
  t_policy.enabled[slot(device_type)] = enabled;
  t_policy.dtype[slot(device_type)] = dtype;
  ++t_policy.nesting;
  install_if_enabled();
}

AutocastGuard::~AutocastGuard() {
  t_policy.enabled[slot(device_type_)] = previous_enabled_;
  t_policy.dtype[slot(device_type_)] = previous_dtype_;
  if (--t_policy.nesting == 0) clear_weight_cast_cache();
  install_if_enabled();
}

void cast_weights_ahead(const std::vector<Tensor>& weights) { t_policy.cast_ahead(weights); }

bool autocast_enabled(DeviceType device_type) { return t_policy.enabled[slot(device_type)]; }
DType autocast_dtype(DeviceType device_type) { return t_policy.dtype[slot(device_type)]; }

AutocastSettings current_autocast_settings() {
  AutocastSettings s;
  for (int i = 0; i < kDeviceTypes; ++i) {
    s.enabled[i] = t_policy.enabled[i];
    s.dtype[i] = t_policy.dtype[i];
  }
  return s;
}

WeightCastCacheStats weight_cast_cache_stats() {
  WeightCastCacheStats s = t_policy.stats;
  s.entries = static_cast<int64_t>(t_policy.cache.size());
  return s;
}

void clear_weight_cast_cache() { t_policy.cache.clear(); }

}  // namespace mpt::amp
