#pragma once
// Fused optimizer updates: on CUDA, multi-tensor kernels (one launch updates
// a whole list of parameters, up to a few dozen tensors per launch, instead
// of eight element-wise kernels per parameter); on the host, one loop per
// parameter with the kernels' roundings. The rules are those of
// models/adamw.h and models/sgd.h, computed in f32 per element, every
// rounding spelled out, so both give the same bits.
#include <cstdint>
#include <vector>

#include "tensor/dtype.h"

namespace mpt::optim::fused {

// Whether this build has the CUDA kernels (false in CPU-only builds); the
// host loops are always there.
bool available();

// One parameter's operands for AdamW: contiguous, same dtype and device.
struct AdamWTensor {
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  int64_t numel;
  float step_size;     // lr / (1 - beta1^t)
  float inv_bc2_sqrt;  // 1 / sqrt(1 - beta2^t)
  // Device-step mode: the parameter's update count so far (f32 [1] on the
  // device); the kernel derives both corrections from it and the device's
  // lr (AdamWScalars::hyper), and the two fields above are unused.
  const float* step = nullptr;
};

// Device-step mode: a group's hyper-parameters, read on the device (f32 [3],
// Optimizer::Group::hyper_on_device), so a replayed graph follows set_lr().
enum HyperSlot { kLr = 0, kDecay = 1 /* 1 - lr * weight_decay */, kWeightDecay = 2 };

// 1 - beta and the like come from the host, worked out in double: in f32,
// 1 - 0.999 is off by 1.3e-5 of itself.
struct AdamWScalars {
  float decay;  // 1 - lr * weight_decay
  float beta1, beta2, eps;
  float one_minus_beta1, one_minus_beta2;
  const float* found_inf = nullptr;  // when set and nonzero, nothing changes
  // Device-step mode (required there): the group's hyper-parameters (see
  // HyperSlot), read in place of `decay`, and the betas as given, for the
  // bias corrections (0.999 rounded to f32 makes 1 - 0.999^1 6.4e-6 small
  // in its square root, so the update would differ from the host's).
  const float* hyper = nullptr;
  double correction_beta1 = 0, correction_beta2 = 0;
};

// On the current device's current stream; dtype f32, f16 or bf16.
void adamw(DType dtype, const std::vector<AdamWTensor>& tensors, const AdamWScalars& s);

// Where adamw_quantized() writes the FP8 copies of an updated f32 weight
// [rows, cols] (both multiples of 16, fewer than 65535 * 64 rows; every
// pointer, the tensor's four too, 16-byte aligned: the caller checks):
// codes of w * scale as prim::quantize_fp8 makes them, row-major and
// transposed, 1 / scale, and |w|'s maximum joined into *amax.
struct QuantizedCopyTarget {
  void* data;    // [rows, cols]
  void* data_t;  // [cols, rows]
  const float* scale;
  float* scale_inv;
  float* amax;
  int64_t rows, cols;
  bool e5m2;  // else E4M3
};
// adamw() for one f32 parameter, writing its FP8 copies in the same pass
// (in a step that found_inf skips, the copies of the unchanged values):
// the update's bits are adamw()'s, the copies' those of quantize_fp8 on
// the updated parameter. CUDA only.
void adamw_quantized(const AdamWTensor& tensor, const QuantizedCopyTarget& copy, const AdamWScalars& s);
// Adds one to each step count (f32 [1] each), unless found_inf (when not
// null) is nonzero: the step that adamw() just took or skipped on the device.
void advance_steps(const std::vector<float*>& steps, const float* found_inf);

struct SGDTensor {
  void* param;
  const void* grad;
  void* momentum_buffer;  // null without momentum
  int64_t numel;
  bool first;  // the buffer starts as this step's direction
  // Device-step mode: the parameter's update count so far (f32 [1] on the
  // device); the buffer also starts afresh when it is 0, so a first update
  // the loss scaler skipped on the device leaves the next one first.
  const float* step = nullptr;
};

struct SGDScalars {
  float lr, weight_decay, momentum;
  float one_minus_dampening;
  bool nesterov;
  const float* found_inf = nullptr;  // when set and nonzero, nothing changes
  // Device-step mode (required there): the group's hyper-parameters (see
  // HyperSlot), read in place of `lr` and `weight_decay`.
  const float* hyper = nullptr;
};

// On the current device's current stream; dtype f32, f16 or bf16.
void sgd(DType dtype, const std::vector<SGDTensor>& tensors, const SGDScalars& s);

// The same updates for tensors in host memory, a large tensor split over
// the CPU backend's threads (without the device-step mode: no step, hyper
// or found_inf pointers).
void adamw_on_host(DType dtype, const std::vector<AdamWTensor>& tensors, const AdamWScalars& s);
void sgd_on_host(DType dtype, const std::vector<SGDTensor>& tensors, const SGDScalars& s);

}  // namespace mpt::optim::fused
