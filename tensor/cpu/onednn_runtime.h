#pragma once
// How the CPU backend runs oneDNN: one engine for the process, a stream per
// calling thread, every call on one thread (the backend's pool splits the
// work, so oneDNN's own OpenMP threads are never started and the two never
// compete for the CPUs), and oneDNN's failures as mpt::Error subclasses.
// Only in builds with oneDNN (MPT_WITH_ONEDNN).
#include <oneapi/dnnl/dnnl.hpp>

#include <string>

namespace mpt::cpu::onednn {

dnnl::engine& engine();
// The calling thread's stream (oneDNN's CPU streams execute in the caller).
dnnl::stream& stream();

// Whether oneDNN's threads can be tied to the backend's pool: its runtime is
// sequential, or OpenMP whose thread count this process can set per thread
// (Debian's libdnnl2 is built with GNU OpenMP). With any other runtime
// oneDNN is left unused: its threads would run beside the pool's. The
// reason, where not, for diagnostics.
bool usable();
const std::string& unusable_reason();

// While alive, oneDNN calls from this thread create and run primitives for
// one thread (OpenMP's thread count for this thread set to 1, and the
// caller's value put back at the end, so a program's own OpenMP regions on
// that thread keep theirs). Primitives remember the count they were made
// for: make them under this as well as run them.
class OneThread {
 public:
  OneThread();
  ~OneThread();
  OneThread(const OneThread&) = delete;
  OneThread& operator=(const OneThread&) = delete;

 private:
  int previous_ = 0;
};

// Throws the mpt::Error subclass for a failed oneDNN call: OutOfMemoryError
// for its allocations, LibraryError otherwise; the message names `what`
// (the op and its shapes) and oneDNN's status and text.
[[noreturn]] void rethrow(const dnnl::error& e, const std::string& what);

}  // namespace mpt::cpu::onednn
