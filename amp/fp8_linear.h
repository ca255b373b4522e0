#pragma once
// A linear layer whose three products run in FP8 (y = x W^T + b):
//
//   forward   y  = x W^T         x, W in E4M3 (fast accumulation)
//   backward  dx = dy W          dy in E5M2, W^T's E4M3 copy
//             dW = dy^T x        dy^T in E5M2, x^T's E4M3 copy (f32 result)
//             db = sum of dy's rows, in f32
//
// Each product reads both operands in the "TN" layout Hopper's FP8 GEMMs
// take; the transposed copies come from the quantizing pass itself (x^T in
// the forward, saved instead of x: one byte an element). The weight is
// quantized once per optimizer step, not once per micro-batch: its FP8
// copies are kept until the weight's storage changes (its version).
//
// The forward product keeps cuBLASLt's fast accumulation (the FP8 tensor
// cores' own accumulator, no periodic promotion to f32): the forward has
// one reduction of in_features terms into a bf16 output, where the error
// stays below bf16's rounding. The backward products promote to f32: dW
// sums over every row of the batch, where the cheaper accumulator loses
// the small terms. Transformer Engine and torchao choose the same
// (Fp8Recipe::forward_fast_accumulation = false promotes the forward too).
//
// Shapes FP8 products cannot take (a size not a multiple of 16) run as a
// plain linear() under the caller's autocast instead, said once per layer
// on stderr.
#include <memory>
#include <string>

#include "amp/fp8_scaling.h"
#include "autograd/ops.h"
#include "tensor/tensor.h"

namespace mpt::amp {

struct Fp8LinearState {
  std::shared_ptr<Fp8Scaling> scaling;
  int64_t input_slot = -1, weight_slot = -1;  // forward group
  int64_t grad_slot = -1;                     // backward group
  // The weight's FP8 copies ([out, in] and [in, out]) and 1 / their scale,
  // made from the weight whose storage and version are recorded here: by
  // fp8_linear when the weight has changed since, or in place by an
  // optimizer's step that updates the weight (optim::Optimizer::
  // write_fp8_copies), which then calls copies_made_from().
  Tensor weight_fp8, weight_fp8_t, weight_scale_inv;
  // Held weakly, and compared as a live storage: a new weight allocated
  // where a freed one was (same address, version 0 again) is not the weight
  // the copies were made from.
  std::weak_ptr<Storage> weight_storage;
  uint64_t weight_version = 0;
  bool warned = false;  // about a shape that ran in higher precision
  // Whether the layer may run as half of an fp8_mlp (nn::linear_gelu_linear
  // asks both layers); else the MLP runs as its three ops.
  bool fused_mlp = true;

  // Whether the copies were made from `weight` as it is now.
  bool copies_are_of(const Tensor& weight) const {
    return weight_fp8.defined() && weight_storage.lock() == weight.storage() && weight_version == weight.version();
  }
  void copies_made_from(const Tensor& weight) {
    weight_storage = weight.storage();
    weight_version = weight.version();
  }

  // Three new slots in `scaling` for one layer, named "<name>.input",
  // "<name>.weight" and "<name>.grad_output".
  static Fp8LinearState for_layer(std::shared_ptr<Fp8Scaling> scaling, const std::string& name = "linear");
};

// Whether layers that have FP8 state run fp8_linear on this thread: on
// inside an Fp8Guard (MixedPrecision's training forward), off by default.
bool fp8_enabled();
class Fp8Guard {
 public:
  explicit Fp8Guard(bool enabled);
  ~Fp8Guard();
  Fp8Guard(const Fp8Guard&) = delete;
  Fp8Guard& operator=(const Fp8Guard&) = delete;

 private:
  bool previous_;
};

// x [..., in] (f32, f16 or bf16), weight [out, in] (f32 master), bias
// [out] or undefined; the result [..., out] in out_dtype (bf16 or f16).
// Gradients reach x, weight and bias as linear()'s do. relu: relu() of the
// result, in the product's epilogue, its backward folded into the
// quantization of the output gradient (as is the bias gradient, summed in
// f32 by the same pass).
Tensor fp8_linear(const Tensor& x, const Tensor& weight, const Tensor& bias, Fp8LinearState& state,
                  DType out_dtype = DType::bf16, bool relu = false);

// One linear layer's parameters and FP8 state, for fp8_mlp.
struct Fp8LayerOperands {
  Tensor weight, bias;  // as fp8_linear's
  Fp8LinearState* state = nullptr;
};

// out(gelu(fc(x))), both layers in FP8: the value, the gradients and the
// scaling state of fp8_linear(gelu(fp8_linear(x, fc), approx), out), bit
// for bit, with GELU folded into the quantizations on either side of it,
// as Transformer Engine's fused MLP does. Forward, GELU is the prologue of
// the quantization of out's input (GELU's output is never stored in 16
// bits); backward, GELU's backward is the prologue of the quantization of
// fc's output gradient (its 16-bit result is never stored either). That
// saves two passes over [rows, hidden] each way. Shapes FP8 products cannot
// take run as the two fp8_linear calls, each with its fallback.
Tensor fp8_mlp(const Tensor& x, const Fp8LayerOperands& fc, const Fp8LayerOperands& out, GeluApprox approx,
               DType out_dtype = DType::bf16);

}  // namespace mpt::amp
