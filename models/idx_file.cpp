#include "models/idx_file.h"

#include <zlib.h>

#include <algorithm>
#include <memory>

#include "tensor/error.h"

namespace mpt::data {
namespace {

// gzopen reads plain files transparently too, so one path serves both.
struct GzFile {
  explicit GzFile(const std::string& path) : path(path), handle(gzopen(path.c_str(), "rb")) {
    check<IOError>(handle != nullptr, "read_idx: cannot open '{}'", path);
  }
  ~GzFile() {
    if (handle) gzclose(handle);
  }
  // Reads up to n bytes; returns how many arrived (fewer only at the end).
  size_t read(void* dst, size_t n) {
    size_t got = 0;
    while (got < n) {
      const unsigned chunk = static_cast<unsigned>(std::min<size_t>(n - got, 1u << 30));
      const int r = gzread(handle, static_cast<char*>(dst) + got, chunk);
      if (r < 0) {
        int code = 0;
        const char* msg = gzerror(handle, &code);
        throw IOError(fmt::format("read_idx: '{}' is not a readable (gzip) file: {}", path, msg ? msg : "?"));
      }
      if (r == 0) break;
      got += static_cast<size_t>(r);
    }
    return got;
  }
  std::string path;
  gzFile handle;
};

}  // namespace

IdxArray read_idx(const std::string& path) {
  GzFile file(path);
  uint8_t magic[4];
  const size_t got = file.read(magic, 4);
  check<IOError>(got == 4, "read_idx: '{}' is too short for an IDX header ({} bytes, need 4)", path, got);
  check<IOError>(magic[0] == 0 && magic[1] == 0,
                 "read_idx: '{}' is not an IDX file (magic bytes {:02x} {:02x}, expected 00 00)", path, magic[0],
                 magic[1]);
  check<IOError>(magic[2] == 0x08,
                 "read_idx: '{}' has element type 0x{:02x}; only unsigned bytes (0x08) are supported", path, magic[2]);
  const int rank = magic[3];
  check<IOError>(rank >= 1 && rank <= 4, "read_idx: '{}' declares {} dimensions; expected 1 to 4", path, rank);

  IdxArray out;
  uint64_t count = 1;
  for (int d = 0; d < rank; ++d) {
    uint8_t b[4];
    check<IOError>(file.read(b, 4) == 4, "read_idx: '{}' ends inside the header (size of dimension {} of {})", path,
                   d, rank);
    const uint32_t size = (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | b[3];
    check<IOError>(size > 0, "read_idx: '{}' has dimension {} of size 0", path, d);
    // Checked before the product, which could wrap around for a hostile header.
    check<IOError>(count <= (uint64_t{1} << 34) / size, "read_idx: '{}' declares an implausible {} x {} elements",
                   path, count, size);
    count *= size;
    out.shape.push_back(size);
  }
  // The values grow as they arrive (doubling from 64 KiB), so a short (or
  // hostile) file that declares billions of elements fails on its length
  // instead of first allocating for them.
  constexpr size_t kFirstChunk = size_t{1} << 16;
  size_t data = 0;
  while (data < count) {
    const size_t want = std::min<size_t>(count - data, std::max(data, kFirstChunk));
    out.values.resize(data + want);
    const size_t got = file.read(out.values.data() + data, want);
    data += got;
    if (got < want) break;
  }
  out.values.resize(data);
  check<IOError>(data == count, "read_idx: '{}' is truncated: {} of {} data bytes for shape [{}]", path, data, count,
                 fmt::join(out.shape, ", "));
  uint8_t extra;
  check<IOError>(file.read(&extra, 1) == 0, "read_idx: '{}' has bytes after the {} data bytes of shape [{}]", path,
                 count, fmt::join(out.shape, ", "));
  return out;
}

}  // namespace mpt::data
