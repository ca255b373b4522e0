#pragma once
// Internal: fused attention through cuDNN's graph API (NVIDIA's
// cudnn-frontend), the CUDA backend's first choice; the own kernels
// (attention.h) run where cuDNN cannot.
// Declarations only (no CUDA headers): the settings are named in every
// build, and tensor/cuda_stubs.cpp defines them without CUDA.
#include <string>

namespace mpt::cuda {

struct Launch;
struct AttentionArgs;
struct AttentionGrads;

// Each runs its pass through cuDNN and returns "", or launches nothing and
// returns why cuDNN could not: cuDNN attention turned off, a build without
// cudnn-frontend, a cuDNN found at run time that is too old, or a shape its
// engines refuse. A graph is built once per shape, layout and stream handle
// and kept; a refusal is kept too, and said once in a debug line
// (MPT_DEBUG=attention). Launches only (workspace from the caching
// allocator), so a CUDA graph can capture them.
std::string cudnn_attention_forward(const Launch& l, const AttentionArgs& a);
std::string cudnn_attention_backward(const Launch& l, const AttentionArgs& a, const AttentionGrads& g);

void set_cudnn_attention(bool on);
bool cudnn_attention();

// The kernel behind the calling thread's last fused attention forward (or
// backward) pass: "cudnn", or "own (<why not cuDNN>)".
void note_attention_kernel(bool backward, std::string what);
std::string last_attention_kernel(bool backward);

}  // namespace mpt::cuda
