#include "tensor/cpu/onednn_runtime.h"

#include <dlfcn.h>

#include "tensor/error.h"

namespace mpt::cpu::onednn {
namespace {

// OpenMP's per-thread count, looked up in the OpenMP runtime oneDNN itself
// links (searched from oneDNN's library down its dependencies), so that it
// is that runtime's setting that changes even where a program has loaded
// another OpenMP beside it. mptrain is not built with OpenMP itself: that
// would bring a second runtime (clang's libomp) into sanitizer builds.
struct OpenMP {
  int (*get_max_threads)() = nullptr;
  void (*set_num_threads)(int) = nullptr;
};

struct Runtime {
  OpenMP omp;
  std::string unusable;  // empty where usable
};

const Runtime& runtime() {
  static const Runtime r = [] {
    Runtime out;
    const unsigned kind = dnnl_version()->cpu_runtime;
    if (kind == DNNL_RUNTIME_SEQ) return out;
    if (kind != DNNL_RUNTIME_OMP) {
      out.unusable = fmt::format("oneDNN's CPU runtime ({}) is neither sequential nor OpenMP", kind);
      return out;
    }
    Dl_info info{};
    void* library = nullptr;
    if (dladdr(reinterpret_cast<void*>(&dnnl_version), &info) != 0 && info.dli_fname != nullptr)
      library = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);  // stays open: oneDNN is linked in for good
    if (library != nullptr) {
      out.omp.get_max_threads = reinterpret_cast<int (*)()>(dlsym(library, "omp_get_max_threads"));
      out.omp.set_num_threads = reinterpret_cast<void (*)(int)>(dlsym(library, "omp_set_num_threads"));
    }
    if (out.omp.get_max_threads == nullptr || out.omp.set_num_threads == nullptr)
      out.unusable = "oneDNN runs on OpenMP, but its omp_set_num_threads was not found";
    return out;
  }();
  return r;
}

}  // namespace

dnnl::engine& engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

dnnl::stream& stream() {
  thread_local dnnl::stream s(engine());
  return s;
}

bool usable() { return runtime().unusable.empty(); }
const std::string& unusable_reason() { return runtime().unusable; }

OneThread::OneThread() {
  const OpenMP& omp = runtime().omp;
  if (omp.set_num_threads == nullptr) return;
  previous_ = omp.get_max_threads();
  if (previous_ != 1) omp.set_num_threads(1);
}

OneThread::~OneThread() {
  if (previous_ > 1) runtime().omp.set_num_threads(previous_);
}

void rethrow(const dnnl::error& e, const std::string& what) {
  const std::string message = fmt::format("{}: oneDNN failed (status {}): {}", what, static_cast<int>(e.status), e.what());
  if (e.status == dnnl_out_of_memory) throw OutOfMemoryError(message);
  throw LibraryError(message);
}

}  // namespace mpt::cpu::onednn
