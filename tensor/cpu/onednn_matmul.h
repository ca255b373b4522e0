#pragma once
// Matrix products through oneDNN's matmul primitive, split over the CPU
// backend's threads (cpu_threads.h) with oneDNN running each piece on the
// thread that took it (onednn_runtime.h). Primitives are made once per
// piece's shapes, strides and dtypes and kept in a bounded cache. Builds
// without oneDNN have these functions too: onednn_matmul() then declines
// every product and Eigen runs them (cpu_gemm.cpp).
#include <cstdint>
#include <string>

#include "tensor/backend_settings.h"
#include "tensor/tensor_view.h"

namespace mpt::cpu {

// Where oneDNN runs the products it can take. kWhereFaster (the default)
// by what was measured (bench/cpu_gemm.cpp, docs/PERFORMANCE.md): batched
// products of at least kOnednnMinMultiplyAdds (it splits them by whole
// products, where Eigen splits each one and runs the small ones on one
// thread: 1.3x to 2.4x faster for gpt_mini's attention on AVX2), and
// single products only on CPUs beyond AVX2 (oneDNN picks AVX-512 and AMX
// kernels at run time, Eigen is built for AVX2; on AVX2 its f32 GEMM is no
// faster than Eigen's, and half as fast on some of the MLP's shapes; on
// AVX-512 with bf16 arithmetic its bf16 products run at 2 to 4.7 times
// Eigen's widened ones, its f32 ones at 0.6 to 1.4 times).
// kAlways runs every product it takes on oneDNN (the tests' setting);
// kNever none (measurements' baseline). Set through set_cpu_onednn
// (backend_settings.h) from outside tensor/.
using OnednnUse = CpuOnednn;

// Below this many multiply-adds Eigen is faster even on one thread: the
// primitive lookup and oneDNN's memory objects cost more than its kernel
// saves (squares: Eigen ahead up to 96^3, even at 128^3).
constexpr int64_t kOnednnMinMultiplyAdds = int64_t{1} << 20;

// out = a @ b (+ bias on every row) as GemmArgs lays them out: a [batch, m,
// k] and b [batch, k, n] with a unit stride in one of their last two
// dimensions and a batch stride of 0 where broadcast, out [batch, m, n]
// contiguous; a and b both f32 or both bf16, out f32 or bf16, bias (data
// nullptr: none) a contiguous [n] vector of f32 or of out's dtype.
// bf16 operands accumulate in f32 and are rounded once. Returns false, with
// out's contents unspecified, where oneDNN does not run it: not chosen (see
// OnednnUse), or a product oneDNN has nothing better than its reference
// kernels for on this CPU (bf16 without AVX-512) or cannot describe
// (overlapping batches); such refusals are cached too. A failure inside
// oneDNN throws (onednn::rethrow) naming the shapes.
bool onednn_matmul(const TensorView& a, const TensorView& b, const TensorView& out, const TensorView& bias);

// Whether onednn_matmul() would hand a product of these operand and
// output dtypes and sizes to oneDNN under the current OnednnUse (oneDNN
// may still decline it when it makes the primitive): for callers that
// lay out their operands differently for it (convolutions' bf16 columns).
bool onednn_chosen(DType in, DType out, int64_t batch, int64_t m, int64_t n, int64_t k);

// Whether this build has oneDNN and it can run here with its threads tied
// to the backend's (else why not, in `reason`).
bool onednn_built();
bool onednn_usable(std::string* reason = nullptr);

// Process-wide; kWhereFaster by default.
void set_onednn_use(OnednnUse use);
OnednnUse onednn_use();

// Counters since the process started, for tests and measurements.
struct OnednnMatmulStats {
  int64_t products = 0;    // run through oneDNN
  int64_t declined = 0;    // large enough, but oneDNN refused them
  int64_t primitives = 0;  // made (cache misses that gave a primitive)
  int64_t cached = 0;      // primitives and refusals in the cache now
  std::string last_implementation;  // oneDNN's name for the last primitive made
};
OnednnMatmulStats onednn_matmul_stats();

}  // namespace mpt::cpu
