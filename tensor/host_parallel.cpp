#include "tensor/host_parallel.h"

#include "tensor/cpu/cpu_threads.h"

namespace mpt {

void parallel_for_host_elements(int64_t n, const std::function<void(int64_t begin, int64_t end)>& f) {
  cpu::parallel_for_elements(n, f);
}

}  // namespace mpt
