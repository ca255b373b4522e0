#pragma once
// How a training step runs: its numerics, whether it is replayed as a CUDA
// graph, how its work is spread over devices and processes, and gradient
// clipping. The names are the ones mpt-train's options take.
#include <string>

#include "amp/fp8_scaling.h"
#include "amp/grad_scaler.h"
#include "tensor/device.h"

namespace mpt::train {

enum class Precision {
  fp32,  // everything in f32
  fp16,  // autocast to f16 with f32 master weights, and the loss scaler (f16's range is narrow)
  bf16,  // autocast to bf16 with f32 master weights (it has f32's range: no scaler)
  // The linear layers' products in FP8 (amp/fp8_linear.h; the model's last
  // linear layer, its output head, stays in bf16), everything else as in
  // bf16. FP8 layers run in training forwards (grad on); evaluation runs
  // them in bf16.
  fp8,
};
const char* precision_name(Precision precision);          // "fp32", "fp16", "bf16", "fp8"
Precision precision_from_name(const std::string& name);   // ValueError naming the choices
// What "auto" means: fp16 on a GPU, bf16 on the CPU (which has no f16 arithmetic).
Precision default_precision(const Device& device);

enum class GraphMode {
  automatic,  // a CUDA graph where the step can be captured (a GPU, not DataParallel)
  on,         // a CUDA graph, or an error naming why it cannot be
  off,        // eager steps
};
const char* graph_mode_name(GraphMode mode);               // "auto", "on", "off"
GraphMode graph_mode_from_name(const std::string& name);

enum class Parallel {
  none,  // one device
  dp,    // DataParallel: one process, a replica per device, one optimizer
  ddp,   // DistributedDataParallel: a process per device, gradients all-reduced
};
const char* parallel_name(Parallel parallel);              // "none", "dp", "ddp"
Parallel parallel_from_name(const std::string& name);

// Whether a loss scaler runs.
enum class LossScaling {
  automatic,  // with fp16 only (bf16 and f32 have f32's range)
  always,     // in every precision (to study a scaler where nothing overflows, say)
  never,      // not even with fp16 (an f16 gradient may then overflow to inf)
};

struct StepOptions {
  Precision precision = Precision::fp32;
  amp::GradScalerOptions scaler;  // the loss scaler's policy and settings
  LossScaling loss_scaling = LossScaling::automatic;
  amp::Fp8Recipe fp8;  // the scaling recipe of Precision::fp8
  // fp8: the optimizer's step writes the weights' FP8 copies where it can
  // (optim::Optimizer::write_fp8_copies), instead of a pass of their own at
  // the next forward: the same bits either way, one read of the f32 weights
  // a step fewer. Off by default: on an H100 it measured no faster
  // (docs/PERFORMANCE.md, "FP8: GELU folded into the quantization").
  bool fp8_copies_in_optimizer = false;
  // fp8: a transformer's MLP (GPT's blocks) runs as one amp::fp8_mlp, GELU
  // folded into the FP8 quantizations around it; off, as its three ops.
  // The same bits either way.
  bool fp8_fused_mlp = true;
  GraphMode cuda_graph = GraphMode::automatic;
  // Clip the gradients' global 2-norm to this (after unscaling, before the
  // optimizer; on the device, so a captured step keeps it); 0: no clipping.
  double max_grad_norm = 0;
  // Autocast's weight casts in one launch before forward, instead of one
  // per op as it reaches each weight.
  bool cast_weights_ahead = true;
};

}  // namespace mpt::train
