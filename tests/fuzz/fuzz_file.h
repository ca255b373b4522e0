#pragma once
// The file readers take paths, so each input is written to a file of this
// process (in memory where /dev/shm exists) and read back through the real
// entry point.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace mpt::fuzz {

inline std::string input_file(const uint8_t* data, size_t size, const char* suffix) {
  static const std::string path = [suffix] {
    const std::filesystem::path dir = std::filesystem::exists("/dev/shm") ? "/dev/shm" : "/tmp";
    return (dir / ("mpt-fuzz-" + std::to_string(::getpid()) + suffix)).string();
  }();
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || (size > 0 && std::fwrite(data, 1, size, f) != size) || std::fclose(f) != 0) std::abort();
  return path;
}

}  // namespace mpt::fuzz
