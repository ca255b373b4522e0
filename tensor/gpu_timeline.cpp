#include "tensor/gpu_timeline.h"

namespace mpt {
namespace {
thread_local GpuTimeline* t_active = nullptr;
}

GpuTimeline* GpuTimeline::active() { return t_active; }

GpuTimeline::Activation::Activation(GpuTimeline* timeline) : previous_(t_active) { t_active = timeline; }

GpuTimeline::Activation::~Activation() { t_active = previous_; }

void gpu_stamp(const Device& device, const std::string& label, void* stream) {
  GpuTimeline* t = GpuTimeline::active();
  if (t && t->device() == device) t->stamp(label, stream);
}

}  // namespace mpt
