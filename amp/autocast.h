#pragma once
// Autocast: inside an AutocastGuard, the differentiable ops run in the
// dtype amp/autocast_policy.h gives them (matmul-like ops in f16 or bf16,
// range-hungry ops in f32, mixed inputs promoted), while parameters stay f32
// master weights.
//
//   {
//     amp::AutocastGuard autocast(DeviceType::cuda, DType::f16);
//     Tensor loss = cross_entropy(model(x), y);   // linear in f16, loss in f32
//   }
//   scaler.scale(loss) ... backward outside or inside the guard, as you like.
//
// Casts are the differentiable `to`, so backward runs in the dtypes forward
// chose and f32 weights receive f32 gradients. The cast of each f32 leaf that
// requires a gradient (a weight) is cached until the outermost guard ends,
// so a weight used many times in a step is cast once.
//
// State is per thread (like grad mode) and nests: an inner guard may switch
// the dtype or turn autocast off for a region; leaving it restores the outer
// setting. Each device type (cpu, cuda) is switched separately; an op follows
// the device of its first floating input.
#include <cstdint>
#include <vector>

#include "tensor/device.h"
#include "tensor/dtype.h"
#include "tensor/tensor.h"

namespace mpt::amp {

class AutocastGuard {
 public:
  // The device type's usual dtype, as in PyTorch: f16 on CUDA, bf16 on the
  // CPU (which has no fast f16 products, and bf16 needs no loss scaler).
  explicit AutocastGuard(DeviceType device_type);
  // dtype must be f16 or bf16 (DTypeError otherwise).
  AutocastGuard(DeviceType device_type, DType dtype, bool enabled = true);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  DeviceType device_type_;
  bool previous_enabled_;
  DType previous_dtype_;
};

// Inside an AutocastGuard: casts every weight of `weights` that the region
// would cast and cache (an f32 leaf that requires a gradient, on a device
// type with autocast on, grad mode on) to the region's dtype in one kernel
// launch per device, and caches the casts, so the region's ops find them
// cast. Their gradients flow back through one cast node per weight, as with
// casts made one at a time, and the values are the same bits. (A model
// casting tens of small weights a step spends more on their launches than
// on their bytes.) Weights of 4Mi elements or more are left to their ops,
// and weights the region's ops never use are cast for nothing.
void cast_weights_ahead(const std::vector<Tensor>& weights);

bool autocast_enabled(DeviceType device_type);
DType autocast_dtype(DeviceType device_type);  // the lower-precision dtype for that device type

// This thread's settings for both device types, to carry into worker threads
// (a data-parallel replica runs its forward under the caller's autocast).
struct AutocastSettings {
  bool enabled[2] = {false, false};  // [cpu, cuda]
  DType dtype[2] = {DType::f16, DType::f16};
};
AutocastSettings current_autocast_settings();

// Applies captured settings for a scope (the worker thread's own weight-cast
// cache lives as long as the guard).
class AutocastSettingsGuard {
 public:
  explicit AutocastSettingsGuard(const AutocastSettings& settings)
      : cpu_(DeviceType::cpu, settings.dtype[0], settings.enabled[0]),
        cuda_(DeviceType::cuda, settings.dtype[1], settings.enabled[1]) {}

 private:
  AutocastGuard cpu_, cuda_;
};

// The weight-cast cache of this thread's outermost autocast region.
struct WeightCastCacheStats {
  int64_t entries = 0;  // casts held now
  int64_t hits = 0;     // uses served from the cache, since the thread started
  int64_t misses = 0;   // casts made and stored, since the thread started
};
WeightCastCacheStats weight_cast_cache_stats();
// Drops the cached casts now (the outermost guard does this when it ends).
void clear_weight_cast_cache();

}  // namespace mpt::amp
