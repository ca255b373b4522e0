#include "models/idx_file.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "tensor/error.h"

namespace mpt::data {
namespace {

// A file read front to back; a gzip file (one member, or several back to
// back as `cat a.gz b.gz` makes) is inflated on the way, a plain one passed
// through. zlib's gzread would stop silently at bytes after the last member;
// here they are refused, as a damaged file.
class FileReader {
 public:
  explicit FileReader(const std::string& path) : path_(path), file_(std::fopen(path.c_str(), "rb")) {
    check<IOError>(file_ != nullptr, "read_idx: cannot open '{}': {}", path, std::strerror(errno));
    // The first bytes say whether the file is gzip; zlib then starts on the
    // input they left in next_in and avail_in. zlib starts last: if it
    // fails there is nothing to end, and file_ closes itself.
    gzip_ = refill() && zs_.avail_in >= 2 && zs_.next_in[0] == 0x1f && zs_.next_in[1] == 0x8b;
    check<IOError>(inflateInit2(&zs_, 16 + MAX_WBITS) == Z_OK,  // 16: gzip wrapping only
                   "read_idx: cannot start inflating '{}': out of memory", path);
  }
  ~FileReader() { inflateEnd(&zs_); }
  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;

  // Reads up to n bytes; returns how many arrived (fewer only at the end).
  size_t read(void* dst, size_t n) {
    auto* out = static_cast<unsigned char*>(dst);
    size_t got = 0;
    while (got < n) {
      if (!gzip_ || !in_member_) {
        if (zs_.avail_in == 0 && !refill()) break;  // the end, in a plain file or between gzip members
        if (!gzip_) {
          const size_t take = std::min<size_t>(n - got, zs_.avail_in);
          std::memcpy(out + got, zs_.next_in, take);
          zs_.next_in += take;
          zs_.avail_in -= static_cast<unsigned>(take);
          got += take;
          continue;
        }
        inflateReset(&zs_);  // bytes follow a member's end: they must start another
        in_member_ = true;
      }
      // Inflate runs even with no input left: it may hold output, or a
      // trailer it has read but not yet checked.
      if (zs_.avail_in == 0) refill();
      zs_.next_out = out + got;
      zs_.avail_out = static_cast<unsigned>(std::min<size_t>(n - got, 1u << 30));
      const int r = inflate(&zs_, Z_NO_FLUSH);
      got = static_cast<size_t>(zs_.next_out - out);
      if (r == Z_STREAM_END) {
        in_member_ = false;
        ++members_;
      } else if (r == Z_BUF_ERROR) {  // no progress: it needs input, and the file has ended
        check<IOError>(members_ > 0, "read_idx: '{}' ends inside its gzip stream (truncated)", path_);
        throw IOError(fmt::format(
            "read_idx: '{}' has {} bytes after the end of its gzip stream that are not a whole gzip member", path_,
            zs_.total_in));
      } else if (r != Z_OK) {
        const char* why = zs_.msg ? zs_.msg : "corrupt data";
        if (members_ > 0)
          throw IOError(fmt::format("read_idx: '{}' has bytes after the end of its gzip stream that are not gzip ({})",
                                    path_, why));
        throw IOError(fmt::format("read_idx: '{}' is not a readable gzip file: {}", path_, why));
      }
    }
    return got;
  }

 private:
  // More raw bytes into the buffer; false at the file's end.
  bool refill() {
    const size_t r = std::fread(buffer_.data(), 1, buffer_.size(), file_.get());
    check<IOError>(!std::ferror(file_.get()), "read_idx: cannot read '{}': {}", path_, std::strerror(errno));
    zs_.next_in = buffer_.data();
    zs_.avail_in = static_cast<unsigned>(r);
    return r > 0;
  }

  struct CloseFile {
    void operator()(std::FILE* f) const { std::fclose(f); }
  };

  std::string path_;
  std::unique_ptr<std::FILE, CloseFile> file_;
  z_stream zs_{};
  std::vector<unsigned char> buffer_ = std::vector<unsigned char>(size_t{1} << 18);
  bool gzip_ = false;
  bool in_member_ = false;  // inside a gzip member (a header read or to come, its end not yet)
  int members_ = 0;         // gzip members inflated to their end
};

}  // namespace

IdxArray read_idx(const std::string& path) {
  FileReader file(path);
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
