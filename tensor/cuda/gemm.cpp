// Batched GEMM through cuBLASLt.
//
// cuBLAS is column-major; our tensors are row-major. A row-major [r, c]
// matrix read column-major is its transpose, so out = a @ b is computed as
// out^T = b^T a^T: cuBLAS's A is b, its B is a, and D is out, with no copies.
// An operand whose last stride is not 1 but whose row stride is (a transposed
// view) is handed over with the transpose flag instead.
//
// Choosing an algorithm (cublasLtMatmulAlgoGetHeuristic) costs far more than
// running a small matmul, and a training step repeats the same shapes, so
// descriptors and the chosen algorithm are cached per problem.
//
// A linear layer's bias rides in the GEMM's epilogue (CUBLASLT_EPILOGUE_BIAS:
// one vector per row of cuBLAS's D, i.e. per column of `out`), and so does
// its bias gradient (CUBLASLT_EPILOGUE_BGRADB: the sums of cuBLAS's B = a^T
// over k, i.e. of a's rows), and a ReLU after the bias (CUBLASLT_EPILOGUE_RELU
// or RELU_BIAS). Where cuBLASLt has no algorithm with the epilogue, or only
// slow ones (the bias gradient on unaligned rows), the product runs plain
// and the epilogue as separate kernels.
#include "tensor/cuda/gemm.h"
#include "tensor/cuda/lt_common.h"

#include <cublasLt.h>

#include <array>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>

#include <fmt/format.h>

#include "tensor/cuda/caching_allocator.h"
#include "tensor/cuda/check.h"
#include "tensor/cuda/cuda_backend.h"
#include "tensor/cuda/runtime.h"
#include "tensor/device_guard.h"
#include "tensor/error.h"

namespace mpt::cuda {
namespace {

thread_local bool t_allow_tf32 = false;

// What NVIDIA recommends for Hopper; most algorithms need far less.
constexpr int kMaxCachedPlans = 4096;

// One column-major cuBLAS operand: the stored matrix and whether cuBLAS
// transposes it.
struct Operand {
  cublasOperation_t op;
  int64_t rows, cols, ld;
};

// The cuBLAS operand that stands for X^T, X a row-major [r, c] view with
// strides (sr, sc).
Operand transposed_operand(int64_t r, int64_t c, int64_t sr, int64_t sc, const char* name) {
  // A dimension of size 1 is never stepped along, so its stride (0 where it
  // was broadcast, anything in a view) is free: take the one cuBLAS accepts.
  if (c == 1) sc = 1;
  if (r == 1) sr = sc == 1 ? std::max<int64_t>(c, 1) : 1;
  // sc == 1: read column-major, X is X^T [c, r] with leading dimension sr.
  if (sc == 1 && sr >= c) return {CUBLAS_OP_N, c, r, sr};
  // sr == 1: X is stored column-major, [r, c] with leading dimension sc.
  if (sr == 1 && sc >= r) return {CUBLAS_OP_T, r, c, sc};
  throw ValueError(fmt::format("CUDA gemm: operand {} of shape [{}, {}] has strides [{}, {}]; cuBLAS needs one of "
                               "them to be 1 and the other at least the matching size (make it contiguous)",
                               name, r, c, sr, sc));
}

struct DTypeInfo {
  cudaDataType_t data;
  cudaDataType_t scale;
  cublasComputeType_t compute;
};

DTypeInfo dtype_info(DType t, bool tf32) {
  switch (t) {
    case DType::f32: return {CUDA_R_32F, CUDA_R_32F, tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F};
    case DType::f16: return {CUDA_R_16F, CUDA_R_32F, CUBLAS_COMPUTE_32F};
    case DType::bf16: return {CUDA_R_16BF, CUDA_R_32F, CUBLAS_COMPUTE_32F};
    case DType::f64: return {CUDA_R_64F, CUDA_R_64F, CUBLAS_COMPUTE_64F};
    default:
      throw DTypeError(fmt::format("CUDA gemm: dtype {} is not supported (f32, f16, bf16, f64)", dtype_name(t)));
  }
}

// The largest power of two (up to 256) dividing the address: algorithms
// may assume the alignment the preference promises.
uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  return a == 0 ? 256u : static_cast<uint32_t>(std::min<uintptr_t>(a & (~a + 1), 256));
}

struct PlanKey {
  int device;
  DType dtype;
  bool tf32;
  cublasOperation_t op_a, op_b;
  int64_t batch, m, n, k;
  int64_t ld_a, ld_b, ld_d, stride_a, stride_b, stride_d;
  uint32_t align_a, align_b, align_d;
  int32_t epilogue;  // cublasLtEpilogue_t
  bool operator==(const PlanKey& o) const { return std::memcmp(this, &o, sizeof(PlanKey)) == 0; }
};

using PlanKeyHash = KeyBytesHash<PlanKey>;

// Whether every operand's rows start 16 bytes apart or a multiple of it.
// cuBLASLt's bias-gradient epilogue (BGRADB) runs on tensor cores only
// then; otherwise its one algorithm is a legacy kernel many times slower
// than the plain product and a separate column sum: for mlp_large's
// classifier (8192 rows of 8192 features into 10 outputs, output gradient
// rows 20 bytes apart) on an H100, bf16 519 us against 59 us and f16 190
// against 61 (bench_gemm_candidates). The bias epilogue (BIAS) had no such
// cost there.
bool leading_dimensions_aligned(const PlanKey& key, size_t element_size) {
  const auto aligned = [&](int64_t ld) { return ld * static_cast<int64_t>(element_size) % 16 == 0; };
  return aligned(key.ld_a) && aligned(key.ld_b) && aligned(key.ld_d);
}

// Descriptors and the chosen algorithm for one problem. Read-only once
// built, except the epilogue's vector pointer, set under `epilogue_mutex`
// for each call.
struct Plan : LtDescriptors {
  cublasLtMatmulHeuristicResult_t heuristic{};
  mutable std::mutex epilogue_mutex;
};

void set_layout_batch(cublasLtMatrixLayout_t layout, int32_t batch, int64_t stride) {
  MPT_CUBLASLT_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof(batch)));
  MPT_CUBLASLT_CHECK(
      cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
}

std::shared_ptr<const Plan> build_plan(const PlanKey& key, cublasLtHandle_t handle) {
  const DTypeInfo info = dtype_info(key.dtype, key.tf32);
  auto plan = std::make_shared<Plan>();
  MPT_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&plan->desc, info.compute, info.scale));
  const int32_t op_a = key.op_a, op_b = key.op_b;
  MPT_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  MPT_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  if (key.epilogue != CUBLASLT_EPILOGUE_DEFAULT)
    MPT_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &key.epilogue,
                                                      sizeof(key.epilogue)));

  // cuBLAS A = b^T: op(A) is [n, k]; B = a^T: op(B) is [k, m]; D = out^T: [n, m].
  const bool ta = key.op_a == CUBLAS_OP_T, tb = key.op_b == CUBLAS_OP_T;
  MPT_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&plan->a, info.data, ta ? key.k : key.n, ta ? key.n : key.k, key.ld_a));
  MPT_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&plan->b, info.data, tb ? key.m : key.k, tb ? key.k : key.m, key.ld_b));
  MPT_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&plan->d, info.data, key.n, key.m, key.ld_d));
  if (key.batch > 1) {
    const auto batch = static_cast<int32_t>(key.batch);
    set_layout_batch(plan->a, batch, key.stride_a);
    set_layout_batch(plan->b, batch, key.stride_b);
    set_layout_batch(plan->d, batch, key.stride_d);
  }

  cublasLtMatmulPreference_t pref = nullptr;
  MPT_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, decltype(&cublasLtMatmulPreferenceDestroy)> pref_owner(
      pref, &cublasLtMatmulPreferenceDestroy);
  const uint64_t workspace = kMaxWorkspace;
  MPT_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                        sizeof(workspace)));
  MPT_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key.align_a,
                                                        sizeof(key.align_a)));
  MPT_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key.align_b,
                                                        sizeof(key.align_b)));
  // C is D (beta scales out in place).
  MPT_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key.align_d,
                                                        sizeof(key.align_d)));
  MPT_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key.align_d,
                                                        sizeof(key.align_d)));
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle, plan->desc, plan->a, plan->b, plan->d, plan->d,
                                                               pref, 1, &plan->heuristic, &found);
  // No algorithm with this epilogue: the caller runs it separately.
  if (key.epilogue != CUBLASLT_EPILOGUE_DEFAULT && (status == CUBLAS_STATUS_NOT_SUPPORTED || found == 0))
    return nullptr;
  MPT_CUBLASLT_CHECK(status);
  if (found == 0)
    throw CudaError(fmt::format("CUDA gemm: cuBLASLt has no algorithm for {} [{}, {}, {}] x [{}, {}, {}] (ops {}{}, "
                                "leading dimensions {}, {}, {})",
                                dtype_name(key.dtype), key.batch, key.m, key.k, key.batch, key.k, key.n,
                                ta ? 'T' : 'N', tb ? 'T' : 'N', key.ld_a, key.ld_b, key.ld_d));
  return plan;
}

std::shared_ptr<const Plan> find_plan(const PlanKey& key, cublasLtHandle_t handle) {
  static std::mutex mutex;
  // Leaked: plans are destroyed through cuBLASLt, which may be gone at exit.
  static auto* cache = new std::unordered_map<PlanKey, std::shared_ptr<const Plan>, PlanKeyHash>();
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (const auto it = cache->find(key); it != cache->end()) return it->second;
  }
  // Built outside the lock: two threads may build the same plan once each.
  auto plan = build_plan(key, handle);
  std::lock_guard<std::mutex> lock(mutex);
  // Programs with endlessly varying shapes would otherwise grow the cache
  // without bound; plans still in use survive through their shared_ptr.
  if (cache->size() >= kMaxCachedPlans) cache->clear();
  return cache->emplace(key, std::move(plan)).first->second;
}

void check_args(const GemmArgs& g) {
  const TensorView &a = g.a, &b = g.b, &out = g.out;
  check<ShapeError>(a.ndim == 3 && b.ndim == 3 && out.ndim == 3,
                    "CUDA gemm: expects 3-d operands [batch, m, k] x [batch, k, n], got {}-d, {}-d and {}-d output",
                    a.ndim, b.ndim, out.ndim);
  check<DTypeError>(a.dtype == b.dtype && a.dtype == out.dtype, "CUDA gemm: dtypes differ ({} x {} -> {})",
                    dtype_name(a.dtype), dtype_name(b.dtype), dtype_name(out.dtype));
  check<ShapeError>(a.shape[0] == out.shape[0] && b.shape[0] == out.shape[0] && a.shape[1] == out.shape[1] &&
                        b.shape[2] == out.shape[2] && a.shape[2] == b.shape[1],
                    "CUDA gemm: shapes [{}, {}, {}] x [{}, {}, {}] -> [{}, {}, {}] do not match", a.shape[0], a.shape[1],
                    a.shape[2], b.shape[0], b.shape[1], b.shape[2], out.shape[0], out.shape[1], out.shape[2]);
  check<ShapeError>(out.strides[2] == 1 && (out.shape[1] == 1 || out.strides[1] >= out.shape[2]),
                    "CUDA gemm: the output needs row-major matrices (strides [{}, {}, {}])", out.strides[0],
                    out.strides[1], out.strides[2]);
  check<ShapeError>(out.shape[0] <= INT32_MAX, "CUDA gemm: batch {} exceeds cuBLASLt's limit", out.shape[0]);
}

// The epilogues that did not run inside the GEMM, as separate kernels.
void add_bias_separately(const GemmArgs& g) {
  TensorView bias = g.out;  // [1, m, n] reading bias[col] for every row
  bias.data = g.bias.data;
  bias.strides[0] = bias.strides[1] = 0;
  bias.strides[2] = 1;
  cuda_backend().binary(BinaryOp::add, g.out, g.out, bias);
}

void sum_rows_separately(const GemmArgs& g) {
  const TensorView& a = g.a;
  const int64_t m = a.shape[1], k = a.shape[2];
  TensorView in = a;  // a as a contiguous [outer, k, inner] block, if it is one
  in.ndim = 3;
  if (a.strides[2] == 1 && (m == 1 || a.strides[1] == k)) {  // [m, k] row-major: reduce the inner dimension
    in.shape[0] = m, in.shape[1] = k, in.shape[2] = 1;
  } else if (a.strides[1] == 1 && (k == 1 || a.strides[2] == m)) {  // stored as [k, m]: reduce the outer one
    in.shape[0] = 1, in.shape[1] = k, in.shape[2] = m;
  } else {
    throw ValueError(fmt::format("CUDA gemm: the bias gradient needs a packed operand a, got strides [{}, {}] for [{}, {}]",
                                 a.strides[1], a.strides[2], m, k));
  }
  in.strides[2] = 1, in.strides[1] = in.shape[2], in.strides[0] = in.shape[1] * in.shape[2];
  cuda_backend().reduce(ReduceOp::sum, g.bias_grad, in, in.shape[0], k, in.shape[2]);
}

}  // namespace

cublasLtHandle_t lt_handle(int device) {
  static std::mutex mutex;
  static std::array<cublasLtHandle_t, 64> handles{};  // never destroyed: used until exit
  check<DeviceError>(device >= 0 && device < static_cast<int>(handles.size()), "CUDA gemm: device index {} out of range",
                     device);
  std::lock_guard<std::mutex> lock(mutex);
  if (!handles[device]) {
    DeviceGuard guard(cuda_device(device));
    MPT_CUBLASLT_CHECK(cublasLtCreate(&handles[device]));
  }
  return handles[device];
}

LtDescriptors::~LtDescriptors() {
  // Destroy calls only free host memory; their status is of no use here.
  if (d) (void)cublasLtMatrixLayoutDestroy(d);
  if (b) (void)cublasLtMatrixLayoutDestroy(b);
  if (a) (void)cublasLtMatrixLayoutDestroy(a);
  if (desc) (void)cublasLtMatmulDescDestroy(desc);
}

void set_allow_tf32(bool allow) { t_allow_tf32 = allow; }
bool allow_tf32() { return t_allow_tf32; }

void gemm(const GemmArgs& g) {
  check_args(g);
  check_gemm_epilogues(g);
  const TensorView &a = g.a, &b = g.b, &out = g.out;
  const int64_t batch = out.shape[0], m = out.shape[1], n = out.shape[2], k = a.shape[2];
  if (batch == 0 || m == 0 || n == 0) {
    // The bias gradient, where it has elements, sums over no rows.
    if (g.bias_grad.data && g.bias_grad.numel() > 0) cuda_backend().fill(g.bias_grad, 0.0);
    return;
  }
  if (k == 0) {  // an empty sum: out = beta * out (cuBLASLt does not take k = 0)
    if (g.beta == 0.0f) cuda_backend().fill(out, 0.0);
    else cuda_backend().unary(UnaryOp::affine, out, out, g.beta, 0.0);
    if (g.bias.data) add_bias_separately(g);
    if (g.relu) cuda_backend().unary(UnaryOp::relu, out, out, 0.0, 0.0);
    if (g.bias_grad.data) cuda_backend().fill(g.bias_grad, 0.0);
    return;
  }
  const Operand op_a = transposed_operand(k, n, b.strides[1], b.strides[2], "b");
  const Operand op_b = transposed_operand(m, k, a.strides[1], a.strides[2], "a");

  PlanKey key;
  std::memset(&key, 0, sizeof(key));  // padding takes part in hashing and comparison
  key.device = current_device();
  key.dtype = out.dtype;
  key.tf32 = out.dtype == DType::f32 && t_allow_tf32;
  key.op_a = op_a.op;
  key.op_b = op_b.op;
  key.batch = batch;
  key.m = m;
  key.n = n;
  key.k = k;
  key.ld_a = op_a.ld;
  key.ld_b = op_b.ld;
  key.ld_d = m == 1 ? n : out.strides[1];
  if (batch > 1) {
    key.stride_a = b.strides[0];
    key.stride_b = a.strides[0];
    key.stride_d = out.strides[0];
  }
  key.align_a = alignment_of(b.data);
  key.align_b = alignment_of(a.data);
  key.align_d = alignment_of(out.data);
  // One vector epilogue fused (the bias if both are asked for), with the
  // ReLU when asked for; the vector must be 16-byte aligned.
  const void* epilogue_vector = g.bias.data ? g.bias.data : g.bias_grad.data;
  const bool bias_grad_only = g.bias_grad.data && !g.bias.data;
  if (epilogue_vector && alignment_of(epilogue_vector) >= 16 &&
      (!bias_grad_only || leading_dimensions_aligned(key, dtype_size(out.dtype))))
    key.epilogue = bias_grad_only ? CUBLASLT_EPILOGUE_BGRADB
                   : g.relu       ? CUBLASLT_EPILOGUE_RELU_BIAS
                                  : CUBLASLT_EPILOGUE_BIAS;
  else
    key.epilogue = g.relu && !epilogue_vector ? CUBLASLT_EPILOGUE_RELU : CUBLASLT_EPILOGUE_DEFAULT;

  const cublasLtHandle_t handle = lt_handle(key.device);
  std::shared_ptr<const Plan> plan = find_plan(key, handle);
  if (!plan) {
    key.epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    plan = find_plan(key, handle);
  }
  const bool bias_fused = key.epilogue == CUBLASLT_EPILOGUE_BIAS || key.epilogue == CUBLASLT_EPILOGUE_RELU_BIAS;
  const bool relu_fused = key.epilogue == CUBLASLT_EPILOGUE_RELU || key.epilogue == CUBLASLT_EPILOGUE_RELU_BIAS;
  const bool bias_grad_fused = key.epilogue == CUBLASLT_EPILOGUE_BGRADB;
  const cudaStream_t stream = current_cuda_stream(key.device);

  // Workspace from the caching allocator, released as soon as the matmul is
  // queued: it can only be reused by later work on this same stream.
  CachingAllocator& allocator = caching_allocator(key.device);
  const size_t workspace_bytes = plan->heuristic.workspaceSize;
  void* workspace = workspace_bytes ? allocator.allocate(workspace_bytes, stream) : nullptr;
  struct Release {
    CachingAllocator& allocator;
    void* ptr;
    ~Release() { allocator.free(ptr); }
  } release{allocator, workspace};

  const double alpha64 = g.alpha, beta64 = g.beta;
  const bool f64 = out.dtype == DType::f64;
  const void* alpha = f64 ? static_cast<const void*>(&alpha64) : static_cast<const void*>(&g.alpha);
  const void* beta = f64 ? static_cast<const void*>(&beta64) : static_cast<const void*>(&g.beta);
  auto run = [&] {
    MPT_CUBLASLT_CHECK(cublasLtMatmul(handle, plan->desc, alpha, b.data, plan->a, a.data, plan->b, beta, out.data,
                                      plan->d, out.data, plan->d, &plan->heuristic.algo, workspace, workspace_bytes,
                                      stream));
  };
  if (key.epilogue == CUBLASLT_EPILOGUE_DEFAULT || key.epilogue == CUBLASLT_EPILOGUE_RELU) {
    run();
  } else {
    // The plan is shared; its vector pointer is this call's only while the lock is held.
    std::lock_guard<std::mutex> lock(plan->epilogue_mutex);
    MPT_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &epilogue_vector,
                                                      sizeof(epilogue_vector)));
    run();
  }
  if (g.bias.data && !bias_fused) add_bias_separately(g);
  if (g.relu && !relu_fused) cuda_backend().unary(UnaryOp::relu, out, out, 0.0, 0.0);
  if (g.bias_grad.data && !bias_grad_fused) sum_rows_separately(g);
}

}  // namespace mpt::cuda
