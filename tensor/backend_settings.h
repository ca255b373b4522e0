#pragma once
// The backends' process-wide settings, for programs, tools and the layers
// above tensor/ (the backends' own headers, tensor/cpu/ and tensor/cuda/,
// are theirs alone).
#include <string>

namespace mpt {

// GPU: whether f32 matmuls and convolutions issued by the calling thread
// may run in TF32 (off by default: f32 means f32; DataParallel's device
// threads take their caller's; no effect without CUDA).
void set_allow_tf32(bool allow);
bool allow_tf32();

// GPU: cuDNN's convolution algorithms timed once per geometry instead of
// taken from its heuristic (off by default; no effect without CUDA).
void set_conv_autotune(bool on);
bool conv_autotune();

// GPU: fused attention through cuDNN (its graph API) wherever it takes the
// shape, the own kernels elsewhere (on by default; off, the own kernels run
// everything; no effect without CUDA).
void set_cudnn_attention(bool on);
bool cudnn_attention();
// The kernel behind the calling thread's last fused attention forward (or
// backward) pass on a GPU: "cudnn", "own (<why not cuDNN>)", or "" before
// the first.
std::string last_attention_kernel(bool backward = false);

// CPU: the threads the backend splits work over (MPT_CPU_THREADS, else the
// CPUs the process may run on; ValueError naming the variable for a value
// that is not a whole number from 1 to 1024), and those CPUs (at least 1:
// a container or `taskset` narrows them).
int cpu_threads();
int usable_cpus();

// CPU: which matrix products run on oneDNN where this build has it
// (tensor/cpu/onednn_matmul.h says why): kWhereFaster (the default), kAlways
// (every product oneDNN takes), kNever (Eigen runs them all). Process-wide;
// no effect without oneDNN. cpu_onednn_usable: whether this build has
// oneDNN and can run it here with its threads tied to the backend's (else
// why not, in `reason`).
enum class CpuOnednn { kNever, kWhereFaster, kAlways };
void set_cpu_onednn(CpuOnednn use);
CpuOnednn cpu_onednn();
bool cpu_onednn_usable(std::string* reason = nullptr);

// CPU: the fused layer norm, softmax cross-entropy and attention kernels
// for f32, f16 and bf16 (on by default; off, autograd composes them from
// element-wise ops, reductions and products, as it always does for f64).
// Process-wide, for measuring one against the other.
void set_cpu_fused_kernels(bool on);
bool cpu_fused_kernels();

}  // namespace mpt
