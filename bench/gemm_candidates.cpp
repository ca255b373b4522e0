// The cuBLASLt algorithms on offer for a linear layer's three products,
// each timed, beside what the library runs (mptrain's linear, its input
// gradient and its weight gradient with the bias gradient). For shapes where
// cuBLASLt's first heuristic is slow: a thin classifier such as mlp_large's
// (8192 rows of 8192 features into 10 outputs). With `pad`, the same
// products with the output dimension padded to a multiple of 8.
//   bench_gemm_candidates ROWS IN OUT [bf16|f16] [candidates]
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "tensor/ops.h"
#include "tensor/stream.h"

namespace {

using namespace mpt;

void check_lt(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(std::string(what) + ": cuBLAS status " + std::to_string(s));
}

// The best mean of four rounds of `reps` calls queued back to back (the
// first round warms up), in microseconds.
double time_us(const Device& gpu, const std::function<void()>& f, int reps = 20) {
  double best = 1e30;
  for (int round = 0; round < 4; ++round) {
    synchronize(gpu);
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) f();
    synchronize(gpu);
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / reps;
    if (round > 0) best = std::min(best, us);
  }
  return best;
}

// One column-major cuBLASLt problem D[rows_d, cols_d] = op(A) op(B), with an
// optional vector epilogue, and every algorithm the heuristic offers for it.
struct LtProblem {
  const char* name;
  cublasOperation_t op_a, op_b;
  int64_t a_rows, a_cols, b_rows, b_cols, d_rows, d_cols;
  const void *a, *b, *vector;
  void* d;
  cublasLtEpilogue_t epilogue;
};

void list_candidates(cublasLtHandle_t handle, const LtProblem& p, cudaDataType_t type, int wanted, const Device& gpu) {
  cublasLtMatmulDesc_t desc = nullptr;
  check_lt(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc");
  check_lt(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &p.op_a, sizeof(p.op_a)), "transa");
  check_lt(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &p.op_b, sizeof(p.op_b)), "transb");
  check_lt(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &p.epilogue, sizeof(p.epilogue)), "epi");
  if (p.vector)
    check_lt(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.vector, sizeof(p.vector)), "bias");
  cublasLtMatrixLayout_t la, lb, ld;
  check_lt(cublasLtMatrixLayoutCreate(&la, type, p.a_rows, p.a_cols, p.a_rows), "la");
  check_lt(cublasLtMatrixLayoutCreate(&lb, type, p.b_rows, p.b_cols, p.b_rows), "lb");
  check_lt(cublasLtMatrixLayoutCreate(&ld, type, p.d_rows, p.d_cols, p.d_rows), "ld");
  cublasLtMatmulPreference_t pref;
  check_lt(cublasLtMatmulPreferenceCreate(&pref), "pref");
  const uint64_t workspace_bytes = uint64_t(32) << 20;
  check_lt(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                              sizeof(workspace_bytes)),
           "workspace");
  std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<size_t>(wanted));
  int found = 0;
  const cublasStatus_t s =
      cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, ld, ld, pref, wanted, results.data(), &found);
  void* workspace = nullptr;
  if (cudaMalloc(&workspace, workspace_bytes) != cudaSuccess) throw std::runtime_error("cudaMalloc");
  std::printf("  cuBLASLt %s, epilogue %d: status %d, %d candidates\n", p.name, static_cast<int>(p.epilogue),
              static_cast<int>(s), found);
  const float alpha = 1.0f, beta = 0.0f;
  for (int i = 0; i < found; ++i) {
    const auto& r = results[static_cast<size_t>(i)];
    int algo_id = -1, tile = -1, splitk = -1, reduction = -1, stages = -1;
    size_t written = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&r.algo, CUBLASLT_ALGO_CONFIG_ID, &algo_id, sizeof(algo_id), &written);
    cublasLtMatmulAlgoConfigGetAttribute(&r.algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &written);
    cublasLtMatmulAlgoConfigGetAttribute(&r.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk), &written);
    cublasLtMatmulAlgoConfigGetAttribute(&r.algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &reduction, sizeof(reduction),
                                         &written);
    cublasLtMatmulAlgoConfigGetAttribute(&r.algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages), &written);
    const double us = time_us(gpu, [&] {
      check_lt(cublasLtMatmul(handle, desc, &alpha, p.a, la, p.b, lb, &beta, p.d, ld, p.d, ld, &r.algo, workspace,
                              workspace_bytes, nullptr),
               "matmul");
    });
    std::printf("    #%d algo %d tile %d splitK %d reduction %d stages %d workspace %zu waves %.2f: %.1f us\n", i, algo_id,
                tile, splitk, reduction, stages, r.workspaceSize, static_cast<double>(r.wavesCount), us);
  }
  cudaFree(workspace);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(ld);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatmulDescDestroy(desc);
}

void run(int64_t rows, int64_t in, int64_t out, DType dtype, int wanted, const Device& gpu) {
  std::printf("%s: %lld rows, %lld -> %lld\n", dtype_name(dtype), static_cast<long long>(rows),
              static_cast<long long>(in), static_cast<long long>(out));
  const Tensor x = randn({rows, in}, dtype, gpu), w = randn({out, in}, dtype, gpu), bias = randn({out}, dtype, gpu);
  const Tensor grad = randn({rows, out}, dtype, gpu);
  std::printf("  mptrain: forward %.1f us, input gradient %.1f us, weight and bias gradients %.1f us\n",
              time_us(gpu, [&] { (void)prim::linear(x, w, bias); }), time_us(gpu, [&] { (void)prim::matmul(grad, w); }),
              time_us(gpu, [&] { (void)prim::linear_weight_grad(grad, x, true); }));
  if (wanted == 0) return;
  cublasLtHandle_t handle;
  check_lt(cublasLtCreate(&handle), "create");
  const cudaDataType_t type = dtype == DType::bf16 ? CUDA_R_16BF : CUDA_R_16F;
  Tensor y = Tensor::empty({rows, out}, dtype, gpu), dx = Tensor::empty({rows, in}, dtype, gpu);
  Tensor dw = Tensor::empty({out, in}, dtype, gpu), db = Tensor::empty({out}, dtype, gpu);
  // Column-major: y^T [out, rows] = w [in, out]^T-read . x^T [in, rows].
  const LtProblem forward{"forward", CUBLAS_OP_T, CUBLAS_OP_N, in, out, in, rows, out, rows,
                          w.data_ptr(), x.data_ptr(), bias.data_ptr(), y.data_ptr(), CUBLASLT_EPILOGUE_BIAS};
  // dx^T [in, rows] = w^T [in, out] . grad^T [out, rows].
  const LtProblem input_grad{"input gradient", CUBLAS_OP_N, CUBLAS_OP_N, in, out, out, rows, in, rows,
                             w.data_ptr(), grad.data_ptr(), nullptr, dx.data_ptr(), CUBLASLT_EPILOGUE_DEFAULT};
  // dw^T [in, out] = x^T [in, rows] . grad [rows, out], the bias gradient from B's sums.
  const LtProblem weight_grad{"weight gradient", CUBLAS_OP_N, CUBLAS_OP_T, in, rows, out, rows, in, out,
                              x.data_ptr(), grad.data_ptr(), db.data_ptr(), dw.data_ptr(), CUBLASLT_EPILOGUE_BGRADB};
  for (const LtProblem& p : {forward, input_grad, weight_grad}) {
    list_candidates(handle, p, type, wanted, gpu);
    if (p.epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
      LtProblem plain = p;
      plain.epilogue = CUBLASLT_EPILOGUE_DEFAULT;
      plain.vector = nullptr;
      list_candidates(handle, plain, type, wanted, gpu);
    }
  }
  cublasLtDestroy(handle);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: bench_gemm_candidates ROWS IN OUT [bf16|f16] [candidates]\n");
    return 2;
  }
  try {
    const Device gpu("cuda:0");
    const DType dtype = argc > 4 && std::string(argv[4]) == "f16" ? DType::f16 : DType::bf16;
    const int wanted = argc > 5 ? std::atoi(argv[5]) : 8;
    run(std::atoll(argv[1]), std::atoll(argv[2]), std::atoll(argv[3]), dtype, wanted, gpu);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gemm_candidates: %s\n", e.what());
    return 1;
  }
  return 0;
}
