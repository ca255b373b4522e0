#include "amp/unscale.h"

#include <cmath>

#include "amp/amp_cuda.h"
#include "tensor/error.h"

namespace mpt::amp {
namespace {

template <typename T>
bool unscale_cpu(const Tensor& g, float inv_scale) {
  T* p = g.data<T>();
  const int64_t n = g.numel();
  bool found = false;
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(p[i]);
    found |= !std::isfinite(v);
    p[i] = T(v * inv_scale);
  }
  return found;
}

template <>
bool unscale_cpu<float>(const Tensor& g, float inv_scale) {
  float* p = g.data<float>();
  const int64_t n = g.numel();
  bool found = false;
  for (int64_t i = 0; i < n; ++i) {
    found |= !std::isfinite(p[i]);
    p[i] *= inv_scale;
  }
  return found;
}

}  // namespace

void unscale_and_check_inf_(std::vector<Tensor>& grads, Tensor& found_inf, const Tensor& inv_scale) {
  check(found_inf.defined() && found_inf.dtype() == DType::f32 && found_inf.numel() == 1,
        "unscale_and_check_inf_: found_inf must be f32 with one element, got {}", describe(found_inf));
  check(inv_scale.defined() && inv_scale.dtype() == DType::f32 && inv_scale.numel() == 1,
        "unscale_and_check_inf_: inv_scale must be f32 with one element, got {}", describe(inv_scale));
  const Device device = found_inf.device();
  check<DeviceError>(inv_scale.device() == device, "unscale_and_check_inf_: inv_scale {} and found_inf {} are on different devices",
                     describe(inv_scale), describe(found_inf));
  for (size_t i = 0; i < grads.size(); ++i) {
    const Tensor& g = grads[i];
    check(g.defined(), "unscale_and_check_inf_: gradient {} is undefined", i);
    check<DeviceError>(g.device() == device, "unscale_and_check_inf_: gradient {} is {}, but found_inf is on {}", i,
                       describe(g), device.str());
    check<DTypeError>(g.dtype() == DType::f32 || g.dtype() == DType::f16 || g.dtype() == DType::bf16,
                      "unscale_and_check_inf_: gradient {} is {}; expected f32, f16 or bf16", i, describe(g));
    check(g.is_contiguous(), "unscale_and_check_inf_: gradient {} ({}) is not contiguous", i, describe(g));
  }
  if (device.is_cuda()) {
    cuda::unscale_and_check_inf(grads, found_inf, inv_scale);
    return;
  }
  const float inv = *inv_scale.data<float>();
  bool found = false;
  for (const Tensor& g : grads) {
    switch (g.dtype()) {
      case DType::f32: found |= unscale_cpu<float>(g, inv); break;
      case DType::f16: found |= unscale_cpu<Half>(g, inv); break;
      default: found |= unscale_cpu<BFloat16>(g, inv); break;
    }
  }
  if (found) *found_inf.data<float>() = 1.0f;
}

}  // namespace mpt::amp
