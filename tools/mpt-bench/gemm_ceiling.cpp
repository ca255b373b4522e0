#include "tools/mpt-bench/gemm_ceiling.h"

#include <vector>

#include "tensor/ops.h"
#include "tensor/random.h"
#include "tensor/stream.h"
#include "tools/mpt-bench/median.h"

namespace mpt::bench {

double gemm_tflops(const Device& device, DType dtype, int64_t n, int reps) {
  Generator gen(0);
  const Tensor a = prim::to(prim::to(randn({n, n}, DType::f32, kCPU, &gen), device), dtype);
  const Tensor b = prim::to(prim::to(randn({n, n}, DType::f32, kCPU, &gen), device), dtype);
  std::vector<double> ms;
  Event start(device, true), end(device, true);
  for (int i = 0; i < reps + 5; ++i) {
    start.record();
    const Tensor c = prim::matmul(a, b);
    end.record();
    end.synchronize();
    if (i >= 5) ms.push_back(start.elapsed_ms(end));
  }
  return 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n) / median(ms) / 1e9;
}

}  // namespace mpt::bench
