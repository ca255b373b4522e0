#include "train/options.h"

#include "tensor/error.h"

namespace mpt::train {

const char* precision_name(Precision precision) {
  switch (precision) {
    case Precision::fp32: return "fp32";
    case Precision::fp16: return "fp16";
    case Precision::bf16: return "bf16";
    case Precision::fp8: return "fp8";
  }
  return "?";
}

Precision precision_from_name(const std::string& name) {
  for (Precision p : {Precision::fp32, Precision::fp16, Precision::bf16, Precision::fp8})
    if (name == precision_name(p)) return p;
  throw ValueError(fmt::format("unknown precision '{}' (fp32, fp16, bf16, fp8)", name));
}

Precision default_precision(const Device& device) { return device.is_cuda() ? Precision::fp16 : Precision::bf16; }

const char* graph_mode_name(GraphMode mode) {
  switch (mode) {
    case GraphMode::automatic: return "auto";
    case GraphMode::on: return "on";
    case GraphMode::off: return "off";
  }
  return "?";
}

GraphMode graph_mode_from_name(const std::string& name) {
  for (GraphMode m : {GraphMode::automatic, GraphMode::on, GraphMode::off})
    if (name == graph_mode_name(m)) return m;
  throw ValueError(fmt::format("unknown CUDA graph mode '{}' (auto, on, off)", name));
}

const char* parallel_name(Parallel parallel) {
  switch (parallel) {
    case Parallel::none: return "none";
    case Parallel::dp: return "dp";
    case Parallel::ddp: return "ddp";
  }
  return "?";
}

Parallel parallel_from_name(const std::string& name) {
  for (Parallel p : {Parallel::none, Parallel::dp, Parallel::ddp})
    if (name == parallel_name(p)) return p;
  throw ValueError(fmt::format("unknown parallel mode '{}' (none, dp, ddp)", name));
}

}  // namespace mpt::train
