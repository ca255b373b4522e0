// FP8 products through cuBLASLt: out [m, n] = (a [m, k] . b [n, k]^T) *
// a_scale_inv * b_scale_inv (+ bias), f32 accumulation.
//
// Hopper's FP8 GEMMs take one layout only, "TN": cuBLAS's A transposed and
// B not. Read column-major, a row-major [n, k] weight is a [k, n] matrix,
// so handing it over as A with the transpose flag, the row-major [m, k]
// input as B without one, and out as the [n, m] column-major D gives out =
// a b^T with no copies: a linear layer's forward, and, with the transposed
// FP8 copies the quantization writes, its two backward products.
//
// The scales are device pointers (CUBLASLT_MATMUL_DESC_{A,B}_SCALE_POINTER),
// so a recipe's scales never come to the host and the product can be
// captured in a CUDA graph. Descriptors and the chosen algorithm are kept
// per problem, as in gemm.cpp.
#include <cublasLt.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>

#include <fmt/format.h>

#include "tensor/cuda/caching_allocator.h"
#include "tensor/cuda/check.h"
#include "tensor/cuda/cuda_backend.h"
#include "tensor/cuda/gemm.h"
#include "tensor/cuda/lt_common.h"
#include "tensor/cuda/runtime.h"
#include "tensor/cuda_info.h"
#include "tensor/error.h"

namespace mpt::cuda {
namespace {

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::e4m3: return CUDA_R_8F_E4M3;
    case DType::e5m2: return CUDA_R_8F_E5M2;
    case DType::f32: return CUDA_R_32F;
    case DType::f16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
    default: throw DTypeError(fmt::format("CUDA gemm_fp8: dtype {} is not supported", dtype_name(t)));
  }
}

struct Fp8PlanKey {
  int device;
  DType a, b, out;
  int64_t m, n, k;
  bool bias;
  bool relu;
  bool fast_accumulation;
  bool operator==(const Fp8PlanKey& o) const { return std::memcmp(this, &o, sizeof(Fp8PlanKey)) == 0; }
};

// Descriptors and algorithm for one problem; the scale and bias pointers
// are set for each call under `mutex`.
struct Fp8Plan : LtDescriptors {
  cublasLtMatmulHeuristicResult_t heuristic{};
  std::mutex mutex;
};

// FP8 tensor-core products exist from compute capability 8.9 (Ada, Hopper).
void check_fp8_capable(int device) {
  static std::mutex mutex;
  static std::unordered_map<int, std::string> refusals;  // device -> "" or why not
  std::lock_guard<std::mutex> lock(mutex);
  auto it = refusals.find(device);
  if (it == refusals.end()) {
    const DeviceProperties p = device_properties(device);
    const bool capable = p.compute_major > 8 || (p.compute_major == 8 && p.compute_minor >= 9);
    it = refusals
             .emplace(device, capable ? std::string()
                                      : fmt::format("gemm_fp8: GPU {} ({}) has compute capability {}.{}; FP8 "
                                                    "products need 8.9 or newer (Ada, Hopper); use bf16 there",
                                                    device, p.name, p.compute_major, p.compute_minor))
             .first;
  }
  if (!it->second.empty()) throw DeviceError(it->second);
}

std::unique_ptr<Fp8Plan> build_plan(const Fp8PlanKey& key, cublasLtHandle_t handle) {
  auto plan = std::make_unique<Fp8Plan>();
  MPT_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const int32_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
  MPT_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)));
  MPT_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)));
  const int8_t fast = key.fast_accumulation ? 1 : 0;
  MPT_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
  if (key.bias || key.relu) {
    const int32_t epilogue = key.bias && key.relu ? CUBLASLT_EPILOGUE_RELU_BIAS
                             : key.bias           ? CUBLASLT_EPILOGUE_BIAS
                                                  : CUBLASLT_EPILOGUE_RELU;
    MPT_CUBLASLT_CHECK(
        cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
  }
  if (key.bias) {
    const int32_t bias_type = cuda_type(key.out);
    MPT_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                                      sizeof(bias_type)));
  }
  // A = b stored [n, k] row-major: column-major [k, n], transposed to [n, k].
  // B = a stored [m, k] row-major: column-major [k, m]. D: [n, m] column-major.
  MPT_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&plan->a, cuda_type(key.b), key.k, key.n, key.k));
  MPT_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&plan->b, cuda_type(key.a), key.k, key.m, key.k));
  MPT_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&plan->d, cuda_type(key.out), key.n, key.m, key.n));

  cublasLtMatmulPreference_t pref = nullptr;
  MPT_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, decltype(&cublasLtMatmulPreferenceDestroy)> pref_owner(
      pref, &cublasLtMatmulPreferenceDestroy);
  const uint64_t workspace = kMaxWorkspace;
  MPT_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                        sizeof(workspace)));
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle, plan->desc, plan->a, plan->b, plan->d, plan->d,
                                                               pref, 1, &plan->heuristic, &found);
  // No algorithm with this epilogue: the caller runs it separately.
  if ((key.bias || key.relu) && (status == CUBLAS_STATUS_NOT_SUPPORTED || found == 0)) return nullptr;
  if (status == CUBLAS_STATUS_NOT_SUPPORTED || found == 0)
    throw CudaError(fmt::format("gemm_fp8: cuBLASLt has no FP8 algorithm for {} [{}, {}] x {} [{}, {}]^T -> {}{}",
                                dtype_name(key.a), key.m, key.k, dtype_name(key.b), key.n, key.k,
                                dtype_name(key.out), key.bias ? " with a bias" : ""));
  MPT_CUBLASLT_CHECK(status);
  return plan;
}

// Null where cuBLASLt has no algorithm with the key's epilogue (kept, so
// that it is asked once).
Fp8Plan* find_plan(const Fp8PlanKey& key, cublasLtHandle_t handle) {
  static std::mutex mutex;
  // Leaked, as gemm.cpp's: plans are destroyed through cuBLASLt, which may be gone at exit.
  static auto* cache = new std::unordered_map<Fp8PlanKey, std::unique_ptr<Fp8Plan>, KeyBytesHash<Fp8PlanKey>>();
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache->find(key);
  if (it == cache->end()) it = cache->emplace(key, build_plan(key, handle)).first;
  return it->second.get();
}

}  // namespace

void gemm_fp8(const Fp8GemmArgs& g) {
  const int device = current_device();
  check_fp8_capable(device);
  for (const TensorView* v : {&g.a, &g.b, &g.out, &g.bias})
    check<ValueError>(reinterpret_cast<uintptr_t>(v->data) % 16 == 0,
                      "gemm_fp8: operands must be 16-byte aligned for cuBLASLt's FP8 products");
  Fp8PlanKey key;
  std::memset(&key, 0, sizeof(key));  // padding takes part in hashing and comparison
  key.device = device;
  key.a = g.a.dtype;
  key.b = g.b.dtype;
  key.out = g.out.dtype;
  key.m = g.a.shape[0];
  key.n = g.b.shape[0];
  key.k = g.a.shape[1];
  // cuBLASLt's FP8 bias epilogue takes a 16-bit bias with a 16-bit output;
  // an f32 output gets its bias (and then its ReLU) from separate kernels.
  const bool epilogue_separately = g.bias.data && g.out.dtype == DType::f32;
  key.bias = g.bias.data && !epilogue_separately;
  key.relu = g.relu && !epilogue_separately;
  key.fast_accumulation = g.fast_accumulation;
  const cublasLtHandle_t handle = lt_handle(device);
  Fp8Plan* found = find_plan(key, handle);
  bool bias_separately = epilogue_separately && g.bias.data, relu_separately = epilogue_separately && g.relu;
  if (!found) {
    bias_separately = g.bias.data != nullptr;
    relu_separately = g.relu;
    key.bias = key.relu = false;
    found = find_plan(key, handle);
  }
  Fp8Plan& plan = *found;
  const cudaStream_t stream = current_cuda_stream(device);

  CachingAllocator& allocator = caching_allocator(device);
  const size_t workspace_bytes = plan.heuristic.workspaceSize;
  void* workspace = workspace_bytes ? allocator.allocate(workspace_bytes, stream) : nullptr;
  struct Release {
    CachingAllocator& allocator;
    void* ptr;
    ~Release() { allocator.free(ptr); }
  } release{allocator, workspace};

  const float alpha = 1.0f, beta = 0.0f;
  // cuBLAS's A is b and its B is a: their scales go the same way.
  const void* a_scale = g.b_scale_inv.data;
  const void* b_scale = g.a_scale_inv.data;
  std::lock_guard<std::mutex> lock(plan.mutex);
  MPT_CUBLASLT_CHECK(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof(a_scale)));
  MPT_CUBLASLT_CHECK(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof(b_scale)));
  if (key.bias)
    MPT_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias.data,
                                                      sizeof(g.bias.data)));
  MPT_CUBLASLT_CHECK(cublasLtMatmul(handle, plan.desc, &alpha, g.b.data, plan.a, g.a.data, plan.b, &beta, g.out.data,
                                    plan.d, g.out.data, plan.d, &plan.heuristic.algo, workspace, workspace_bytes,
                                    stream));
  if (bias_separately) {
    TensorView bias = g.out;  // [m, n] reading bias[col] for every row
    bias.data = g.bias.data;
    bias.strides[0] = 0;
    cuda_backend().binary(BinaryOp::add, g.out, g.out, bias);
  }
  if (relu_separately) cuda_backend().unary(UnaryOp::relu, g.out, g.out, 0.0, 0.0);
}

}  // namespace mpt::cuda
