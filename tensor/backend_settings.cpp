#include "tensor/backend_settings.h"

#include "tensor/cpu/cpu_threads.h"
#include "tensor/cuda/conv_cudnn.h"
#include "tensor/cuda/gemm.h"

namespace mpt {

void set_allow_tf32(bool allow) { cuda::set_allow_tf32(allow); }
bool allow_tf32() { return cuda::allow_tf32(); }
void set_conv_autotune(bool on) { cuda::set_conv_autotune(on); }
bool conv_autotune() { return cuda::conv_autotune(); }
int cpu_threads() { return cpu::cpu_threads(); }
int usable_cpus() { return cpu::usable_cpus(); }

}  // namespace mpt
