#include "tensor/cuda/check.h"

#include <cstdio>

#include <fmt/format.h>

#include "tensor/error.h"

namespace mpt::cuda {

void throw_cuda_error(cudaError_t status, const char* expr, const char* file, int line) {
  // Reset the runtime's last-error slot, so that the next launch check does
  // not report this failure a second time against an unrelated kernel.
  // (Sticky errors such as an illegal address stay; nothing can clear them.)
  (void)cudaGetLastError();
  throw CudaError(fmt::format("{} failed: {} ({}: {}) at {}:{}", expr, cudaGetErrorName(status),
                              static_cast<int>(status), cudaGetErrorString(status), file, line));
}

void throw_library_error(const char* library, int status, const char* status_name, const char* status_text,
                         const char* expr, const char* file, int line) {
  throw CudaError(fmt::format("{} failed: {} error {}{}{} ({}) at {}:{}", expr, library, status,
                              status_name ? " " : "", status_name ? status_name : "",
                              status_text ? status_text : "no description", file, line));
}

void report_release_failure(const char* library, int status, const char* status_text, const char* expr,
                            const char* file, int line) {
  std::fprintf(stderr, "mptrain: warning: %s failed while releasing: %s error %d (%s) at %s:%d\n", expr, library,
               status, status_text ? status_text : "no description", file, line);
}

}  // namespace mpt::cuda
