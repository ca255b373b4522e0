#include "models/data_fingerprint.h"

#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "tensor/error.h"

namespace mpt::data {

std::string content_fingerprint(const std::vector<std::string>& paths) {
  uLong crc = crc32(0L, Z_NULL, 0);
  uint64_t bytes = 0;
  std::vector<char> chunk(size_t{1} << 20);
  for (const std::string& path : paths) {
    std::ifstream in(path, std::ios::binary);
    check<IOError>(in.is_open(), "content_fingerprint: cannot open '{}': {}", path, std::strerror(errno));
    while (in) {
      in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
      const auto got = static_cast<uInt>(in.gcount());
      crc = crc32(crc, reinterpret_cast<const Bytef*>(chunk.data()), got);
      bytes += got;
    }
    check<IOError>(in.eof(), "content_fingerprint: cannot read '{}'", path);
  }
  return fmt::format("{} bytes, crc32 {:08x}", bytes, static_cast<uint32_t>(crc));
}

}  // namespace mpt::data
