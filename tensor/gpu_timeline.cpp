#include "tensor/gpu_timeline.h"

namespace mpt {
namespace {
thread_local GpuTimeline* t_active = nullptr;
}

GpuTimeline* GpuTimeline::active() { return t_active; }

GpuTimeline::Activation::Activation(GpuTimeline* timeline) : previous_(t_active) { t_active = timeline; }

GpuTimeline::Activation::~Activation() { t_active = previous_; }

}  // namespace mpt
