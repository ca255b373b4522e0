#pragma once
// The library's exceptions. Every failure the library can detect surfaces as
// an mpt::Error subclass carrying enough context (op, shapes, dtypes, devices,
// sizes) to act on; the library never calls exit() or abort().
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace mpt {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Operand shapes that do not fit the op.
class ShapeError : public Error { using Error::Error; };
// Operand dtypes that the op does not accept or that disagree.
class DTypeError : public Error { using Error::Error; };
// Operands on different devices, or a device that does not exist.
class DeviceError : public Error { using Error::Error; };
// An argument outside its valid range (negative learning rate, bad index, ...).
class ValueError : public Error { using Error::Error; };
// A device allocation that could not be satisfied, even after freeing caches.
class OutOfMemoryError : public Error { using Error::Error; };
// A failed CUDA runtime / cuBLAS / cuDNN / NCCL call.
class CudaError : public Error { using Error::Error; };
// A failed call into a library the CPU backend runs its kernels on (oneDNN).
class LibraryError : public Error { using Error::Error; };
// A file that could not be read or written, or whose contents are malformed.
class IOError : public Error { using Error::Error; };
// A feature that was not compiled into this build.
class NotAvailableError : public Error { using Error::Error; };

// Throws E with a fmt-formatted message when cond is false.
template <typename E = ValueError, typename... Args>
inline void check(bool cond, fmt::format_string<Args...> f, Args&&... args) {
  if (!cond) throw E(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace mpt
