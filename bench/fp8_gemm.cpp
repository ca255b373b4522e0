// One FP8 product on the GPU, for the side-by-side with PyTorch's
// torch._scaled_mm (scripts/fp8_vs_torch.py runs both on the same codes):
// a [m, k] and b [n, k] hold E4M3 codes made by a formula both sides
// compute (no file to pass), the scales are 1/4 and 1/2, out = (a . b^T)
// * 1/8. Writes the f32 product to --out (raw little-endian floats) and
// prints one JSON line with the time of the bf16-output product.
//   bench_fp8_gemm M N K OUT [fast_accumulation 0|1] [reps]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "tensor/ops.h"
#include "tensor/stream.h"

namespace {

// Codes of a [rows, cols] E4M3 matrix: a mix of every magnitude, NaN's two
// codes (0x7F, 0xFF) moved to their neighbours. The script makes the same.
std::vector<uint8_t> codes(int64_t rows, int64_t cols, int64_t p, int64_t q) {
  std::vector<uint8_t> c(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      auto v = static_cast<uint8_t>((i * p + j * q) % 251);
      if ((v & 0x7F) == 0x7F) v ^= 1;
      c[static_cast<size_t>(i * cols + j)] = v;
    }
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace mpt;
  if (argc < 5) {
    std::fprintf(stderr, "usage: bench_fp8_gemm M N K OUT [fast_accumulation 0|1] [reps]\n");
    return 2;
  }
  const int64_t m = std::atoll(argv[1]), n = std::atoll(argv[2]), k = std::atoll(argv[3]);
  const bool fast = argc > 5 && std::atoi(argv[5]) != 0;
  const int reps = argc > 6 ? std::atoi(argv[6]) : 20;
  try {
    const Device gpu("cuda:0");
    auto matrix = [&](const std::vector<uint8_t>& c, int64_t rows, int64_t cols) {
      Tensor t = Tensor::empty({rows, cols}, DType::e4m3);
      std::copy(c.begin(), c.end(), static_cast<uint8_t*>(t.data_ptr()));
      return prim::to(t, gpu);
    };
    const Tensor a = matrix(codes(m, k, 131, 71), m, k), b = matrix(codes(n, k, 37, 113), n, k);
    const Tensor sa = full({1}, 0.25, DType::f32, gpu), sb = full({1}, 0.5, DType::f32, gpu);
    const std::vector<float> product = prim::gemm_fp8(a, sa, b, sb, Tensor(), DType::f32, fast).to_vector<float>();
    std::ofstream(argv[4], std::ios::binary)
        .write(reinterpret_cast<const char*>(product.data()), static_cast<std::streamsize>(product.size() * 4));
    // Rounds of `reps` products queued back to back (launch costs hidden
    // behind the GPU's work, as in a training step), the best round's
    // mean; the first round warms up.
    double med = 1e30;
    for (int round = 0; round < 4; ++round) {
      synchronize(gpu);
      const auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r) (void)prim::gemm_fp8(a, sa, b, sb, Tensor(), DType::bf16, fast);
      synchronize(gpu);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / reps;
      if (round > 0) med = std::min(med, ms);
    }
    std::printf("{\"m\": %lld, \"n\": %lld, \"k\": %lld, \"fast_accumulation\": %s, \"ms\": %.4f, \"tflops\": %.1f}\n",
                static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k), fast ? "true" : "false",
                med, 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) / med / 1e9);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_fp8_gemm: %s\n", e.what());
    return 1;
  }
  return 0;
}
