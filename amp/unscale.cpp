#include "amp/unscale.h"

#include <cmath>

#include "amp/amp_cuda.h"
#include "tensor/error.h"

namespace mpt::amp {
namespace {

// Multiplies by inv_scale unless `check_only`; true when an element is inf/NaN.
template <typename T>
bool unscale_cpu(const Tensor& g, float inv_scale, bool check_only) {
  T* p = g.data<T>();
  const int64_t n = g.numel();
  bool found = false;
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(p[i]);
    found |= !std::isfinite(v);
    if (!check_only) p[i] = T(v * inv_scale);
  }
  return found;
}

template <>
bool unscale_cpu<float>(const Tensor& g, float inv_scale, bool check_only) {
  float* p = g.data<float>();
  const int64_t n = g.numel();
  bool found = false;
  for (int64_t i = 0; i < n; ++i) {
    found |= !std::isfinite(p[i]);
    if (!check_only) p[i] *= inv_scale;
  }
  return found;
}

// inv_scale undefined: the check alone.
void check_and_maybe_unscale(const char* fn, const std::vector<Tensor>& grads, Tensor& found_inf,
                             const Tensor& inv_scale) {
  check(found_inf.defined() && found_inf.dtype() == DType::f32 && found_inf.numel() == 1,
        "{}: found_inf must be f32 with one element, got {}", fn, describe(found_inf));
  const Device device = found_inf.device();
  if (inv_scale.defined()) {
    check(inv_scale.dtype() == DType::f32 && inv_scale.numel() == 1,
          "{}: inv_scale must be f32 with one element, got {}", fn, describe(inv_scale));
    check<DeviceError>(inv_scale.device() == device, "{}: inv_scale {} and found_inf {} are on different devices", fn,
                       describe(inv_scale), describe(found_inf));
  }
  for (size_t i = 0; i < grads.size(); ++i) {
    const Tensor& g = grads[i];
    check(g.defined(), "{}: gradient {} is undefined", fn, i);
    if (g.device() != device)
      throw DeviceError(fmt::format("{}: gradient {} is {}, but found_inf is on {}", fn, i, describe(g), device.str()));
    check<DTypeError>(g.dtype() == DType::f32 || g.dtype() == DType::f16 || g.dtype() == DType::bf16,
                      "{}: gradient {} is {}; expected f32, f16 or bf16", fn, i, describe(g));
    check(g.is_contiguous(), "{}: gradient {} ({}) is not contiguous", fn, i, describe(g));
  }
  if (device.is_cuda()) {
    cuda::unscale_and_check_inf(grads, found_inf, inv_scale);
    return;
  }
  const bool check_only = !inv_scale.defined();
  const float inv = check_only ? 1.0f : *inv_scale.data<float>();
  bool found = false;
  for (const Tensor& g : grads) {
    switch (g.dtype()) {
      case DType::f32: found |= unscale_cpu<float>(g, inv, check_only); break;
      case DType::f16: found |= unscale_cpu<Half>(g, inv, check_only); break;
      default: found |= unscale_cpu<BFloat16>(g, inv, check_only); break;
    }
  }
  if (found) *found_inf.data<float>() = 1.0f;
}

}  // namespace

void unscale_and_check_inf_(std::vector<Tensor>& grads, Tensor& found_inf, const Tensor& inv_scale) {
  check(inv_scale.defined(), "unscale_and_check_inf_: inv_scale is undefined");
  check_and_maybe_unscale("unscale_and_check_inf_", grads, found_inf, inv_scale);
}

void check_inf_(const std::vector<Tensor>& grads, Tensor& found_inf) {
  check_and_maybe_unscale("check_inf_", grads, found_inf, Tensor());
}

}  // namespace mpt::amp
