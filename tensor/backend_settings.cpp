#include "tensor/backend_settings.h"

#include "tensor/cpu/cpu_kernels.h"
#include "tensor/cpu/cpu_threads.h"
#include "tensor/cpu/onednn_matmul.h"
#include "tensor/cuda/attention_cudnn.h"
#include "tensor/cuda/conv_cudnn.h"
#include "tensor/cuda/gemm.h"

namespace mpt {

void set_allow_tf32(bool allow) { cuda::set_allow_tf32(allow); }
bool allow_tf32() { return cuda::allow_tf32(); }
void set_conv_autotune(bool on) { cuda::set_conv_autotune(on); }
bool conv_autotune() { return cuda::conv_autotune(); }
void set_cudnn_attention(bool on) { cuda::set_cudnn_attention(on); }
bool cudnn_attention() { return cuda::cudnn_attention(); }
std::string last_attention_kernel(bool backward) { return cuda::last_attention_kernel(backward); }
int cpu_threads() { return cpu::cpu_threads(); }
int usable_cpus() { return cpu::usable_cpus(); }
void set_cpu_onednn(CpuOnednn use) { cpu::set_onednn_use(use); }
CpuOnednn cpu_onednn() { return cpu::onednn_use(); }
bool cpu_onednn_usable(std::string* reason) { return cpu::onednn_usable(reason); }
void set_cpu_fused_kernels(bool on) { cpu::set_fused_kernels(on); }
bool cpu_fused_kernels() { return cpu::fused_kernels(); }

}  // namespace mpt
