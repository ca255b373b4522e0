#pragma once
// Status checks for the CUDA runtime and the CUDA libraries. A failing call
// throws mpt::CudaError naming the call as written, the library's error name
// and text, and file:line. Only <cuda_runtime.h> is needed here: the cuBLAS,
// cuDNN and NCCL macros fetch their error strings where they are used (the
// caller includes and links that library anyway), so this header pulls in no
// library that a translation unit does not already use.
#include <cuda_runtime.h>

namespace mpt::cuda {

// Throw mpt::CudaError. Kept out of line so that kernel files compile without
// fmt and the exception machinery stays off the fast path.
[[noreturn]] void throw_cuda_error(cudaError_t status, const char* expr, const char* file, int line);
[[noreturn]] void throw_library_error(const char* library, int status, const char* status_name,
                                      const char* status_text, const char* expr, const char* file, int line);

// For destructors and other places that cannot throw: a release that fails
// is reported on standard error rather than dropped.
void report_release_failure(const char* library, int status, const char* status_text, const char* expr,
                            const char* file, int line);

}  // namespace mpt::cuda

#define MPT_CUDA_CHECK(expr)                                                             \
  do {                                                                                   \
    const cudaError_t mpt_status_ = (expr);                                              \
    if (mpt_status_ != cudaSuccess) ::mpt::cuda::throw_cuda_error(mpt_status_, #expr, __FILE__, __LINE__); \
  } while (0)

// After every kernel launch: reports bad launch configurations at the launch
// site (errors inside the kernel surface later, at the next synchronizing call).
#define MPT_CUDA_CHECK_LAUNCH(kernel_name)                                               \
  do {                                                                                   \
    const cudaError_t mpt_status_ = cudaGetLastError();                                  \
    if (mpt_status_ != cudaSuccess)                                                      \
      ::mpt::cuda::throw_cuda_error(mpt_status_, "launch of " kernel_name, __FILE__, __LINE__); \
  } while (0)

#define MPT_CUBLAS_CHECK(expr)                                                                      \
  do {                                                                                              \
    const cublasStatus_t mpt_status_ = (expr);                                                      \
    if (mpt_status_ != CUBLAS_STATUS_SUCCESS)                                                       \
      ::mpt::cuda::throw_library_error("cuBLAS", static_cast<int>(mpt_status_), cublasGetStatusName(mpt_status_), \
                                       cublasGetStatusString(mpt_status_), #expr, __FILE__, __LINE__); \
  } while (0)

// cuBLASLt returns cublasStatus_t too, but names it with its own functions,
// so code that uses only cuBLASLt does not need libcublas.
#define MPT_CUBLASLT_CHECK(expr)                                                                    \
  do {                                                                                              \
    const cublasStatus_t mpt_status_ = (expr);                                                      \
    if (mpt_status_ != CUBLAS_STATUS_SUCCESS)                                                       \
      ::mpt::cuda::throw_library_error("cuBLASLt", static_cast<int>(mpt_status_),                   \
                                       cublasLtGetStatusName(mpt_status_),                          \
                                       cublasLtGetStatusString(mpt_status_), #expr, __FILE__, __LINE__); \
  } while (0)

#define MPT_CUDNN_CHECK(expr)                                                                       \
  do {                                                                                              \
    const cudnnStatus_t mpt_status_ = (expr);                                                       \
    if (mpt_status_ != CUDNN_STATUS_SUCCESS)                                                        \
      ::mpt::cuda::throw_library_error("cuDNN", static_cast<int>(mpt_status_), nullptr,             \
                                       cudnnGetErrorString(mpt_status_), #expr, __FILE__, __LINE__); \
  } while (0)

// ncclInProgress is not a failure: it is what non-blocking communicators
// return while an operation is still being set up.
#define MPT_NCCL_CHECK(expr)                                                                        \
  do {                                                                                              \
    const ncclResult_t mpt_status_ = (expr);                                                        \
    if (mpt_status_ != ncclSuccess && mpt_status_ != ncclInProgress)                                \
      ::mpt::cuda::throw_library_error("NCCL", static_cast<int>(mpt_status_), nullptr,              \
                                       ncclGetErrorString(mpt_status_), #expr, __FILE__, __LINE__); \
  } while (0)

// A release in a destructor: the runtime's last-error slot is cleared (so no
// later launch check blames an unrelated kernel) and the failure reported,
// except when the runtime is already unloading at process exit.
#define MPT_CUDA_RELEASE(expr)                                                                      \
  do {                                                                                              \
    const cudaError_t mpt_status_ = (expr);                                                         \
    if (mpt_status_ != cudaSuccess) {                                                               \
      (void)cudaGetLastError();                                                                     \
      if (mpt_status_ != cudaErrorCudartUnloading)                                                  \
        ::mpt::cuda::report_release_failure("CUDA", static_cast<int>(mpt_status_),                  \
                                            cudaGetErrorString(mpt_status_), #expr, __FILE__, __LINE__); \
    }                                                                                               \
  } while (0)

#define MPT_NCCL_RELEASE(expr)                                                                      \
  do {                                                                                              \
    const ncclResult_t mpt_status_ = (expr);                                                        \
    if (mpt_status_ != ncclSuccess && mpt_status_ != ncclInProgress)                                \
      ::mpt::cuda::report_release_failure("NCCL", static_cast<int>(mpt_status_),                    \
                                          ncclGetErrorString(mpt_status_), #expr, __FILE__, __LINE__); \
  } while (0)
