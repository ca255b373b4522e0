#pragma once
// An output file of a tool, written under a temporary name beside it and
// renamed over it once whole: a failure on the way (a full disk, an error
// in a later output of the same command, a kill) leaves the file that was
// there before, never a truncated one. A command with several outputs
// commits them together at its end.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>

#include <fmt/format.h>

#include "tensor/error.h"

namespace mpt::tools {

class AtomicOutput {
 public:
  // The temporary keeps the file's extension (a trace's format follows it).
  explicit AtomicOutput(std::string path) : path_(std::move(path)) {
    const std::filesystem::path p(path_);
    temp_ = (p.parent_path() / fmt::format(".{}.partial-{}{}", p.stem().string(), ::getpid(), p.extension().string()))
                .string();
  }
  ~AtomicOutput() {
    if (committed_) return;
    std::error_code ignored;
    std::filesystem::remove(temp_, ignored);
  }
  AtomicOutput(const AtomicOutput&) = delete;
  AtomicOutput& operator=(const AtomicOutput&) = delete;

  // Where to write (and close) the contents.
  const std::string& temp_path() const { return temp_; }
  // The contents reach the disk, then take the file's name.
  void commit() {
    const int fd = ::open(temp_.c_str(), O_RDONLY | O_CLOEXEC);
    check<IOError>(fd >= 0, "cannot write '{}': {}", path_, std::strerror(errno));
    const bool synced = ::fsync(fd) == 0;
    const int error = errno;
    ::close(fd);
    check<IOError>(synced, "cannot write '{}': {}", path_, std::strerror(error));
    std::error_code ec;
    std::filesystem::rename(temp_, path_, ec);
    check<IOError>(!ec, "cannot write '{}': {}", path_, ec.message());
    committed_ = true;
  }

 private:
  std::string path_, temp_;
  bool committed_ = false;
};

}  // namespace mpt::tools
