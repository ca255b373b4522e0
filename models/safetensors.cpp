#include "models/safetensors.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tensor/host_name.h"
#include "tensor/ops.h"

namespace mpt::io {
namespace {

using json = nlohmann::json;

// Tensor bytes are copied as they lie in memory; the format is little-endian.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

// Hugging Face's reader refuses headers above 100 MB; so do we.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

const char* format_dtype(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::f16: return "F16";
    case DType::bf16: return "BF16";
    case DType::f64: return "F64";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
    case DType::u8: return "U8";
    case DType::e4m3: return "F8_E4M3";  // the names Hugging Face's safetensors and PyTorch use
    case DType::e5m2: return "F8_E5M2";
  }
  return "?";
}

std::optional<DType> parse_dtype(const std::string& s) {
  for (DType t : kAllDTypes)
    if (s == format_dtype(t)) return t;
  return std::nullopt;
}

uint32_t crc32_of(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const Bytef*>(data);
  while (n > 0) {
    const uInt chunk = static_cast<uInt>(std::min<size_t>(n, 1u << 30));
    crc = static_cast<uint32_t>(crc32(crc, p, chunk));
    p += chunk;
    n -= chunk;
  }
  return crc;
}

// The header as the file holds it: compact JSON padded with spaces so the
// data starts 8-byte aligned (as the reference writer does).
// A header value for a message: its first 80 characters at most (a shape
// may be a hundred megabytes of digits).
std::string brief(const json& value) {
  std::string text = value.dump();
  if (text.size() > 80) text = text.substr(0, 77) + "...";
  return text;
}

std::string header_text(const json& header) {
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

// The checksum covers the header as it reads without the checksum entry
// (nlohmann's objects are sorted, so the dump is canonical) and every data byte.
uint32_t checksum(const json& header_without_crc, const std::vector<uint8_t>& data) {
  const std::string h = header_without_crc.dump();
  return crc32_of(crc32_of(static_cast<uint32_t>(crc32(0, nullptr, 0)), h.data(), h.size()), data.data(), data.size());
}

std::string hex32(uint32_t v) { return fmt::format("{:08x}", v); }

// The header is JSON, which holds only UTF-8 text: a name or metadata
// string that is not is refused before any file exists (shown with the
// bad bytes replaced).
void check_utf8(const std::string& path, const std::string& text, const char* what) {
  try {
    (void)json(text).dump();
  } catch (const json::type_error&) {
    throw ValueError(fmt::format("save_safetensors('{}'): {} {} is not valid UTF-8", path, what,
                                 json(text).dump(-1, ' ', false, json::error_handler_t::replace)));
  }
}

// A file descriptor that closes itself; writes all or throws.
class OutputFile {
 public:
  explicit OutputFile(const std::string& path) : path_(path) {
    // Exclusive: a temporary's name is this save's alone (see temporary_name).
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    check<IOError>(fd_ >= 0, "save_safetensors: cannot create '{}': {}", path, std::strerror(errno));
  }
  ~OutputFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  void write(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0 && errno == EINTR) continue;
      check<IOError>(w > 0, "save_safetensors: writing '{}' failed: {}", path_, std::strerror(errno));
      p += w;
      n -= static_cast<size_t>(w);
    }
  }
  void sync_and_close() {
    check<IOError>(::fsync(fd_) == 0, "save_safetensors: fsync of '{}' failed: {}", path_, std::strerror(errno));
    const int fd = fd_;
    fd_ = -1;
    check<IOError>(::close(fd) == 0, "save_safetensors: closing '{}' failed: {}", path_, std::strerror(errno));
  }

 private:
  std::string path_;
  int fd_ = -1;
};

void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  check<IOError>(fd >= 0, "save_safetensors: cannot open folder '{}' to sync it: {}", dir, std::strerror(errno));
  const int rc = ::fsync(fd);
  const int fsync_errno = errno;
  const int closed = ::close(fd);
  check<IOError>(rc == 0, "save_safetensors: fsync of folder '{}' failed: {}", dir, std::strerror(fsync_errno));
  check<IOError>(closed == 0, "save_safetensors: closing folder '{}' failed: {}", dir, std::strerror(errno));
}

// The host's name is in temporaries' names: on a folder that several hosts
// share, only this host's processes can be asked whether they still run.
std::string temporary_prefix(const std::string& target_name) {
  return fmt::format(".{}.tmp.{}.", target_name, host_name());
}

// ".<name>.tmp.<host>.<pid>.<n>": the process, and which of its saves (two
// threads may save to one path at once), so no two saves share a file.
std::string temporary_name(const std::string& target_name) {
  static std::atomic<uint64_t> saves{0};
  return fmt::format("{}{}.{}", temporary_prefix(target_name), ::getpid(), saves++);
}

// Temporaries of `target` that writers on this host left when they were
// killed mid-write (a temporary_name whose pid no longer runs) are removed,
// so kills do not fill the folder; a live writer's temporary, and any other
// host's, is left alone. Nothing here may fail the save.
void remove_stale_temporaries(const std::filesystem::path& dir, const std::string& target_name) {
  namespace fs = std::filesystem;
  const std::string prefix = temporary_prefix(target_name);
  auto whole_number = [](const std::string& s) {
    return !s.empty() && s.size() <= 18 && s.find_first_not_of("0123456789") == std::string::npos;
  };
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    const std::string rest = name.substr(prefix.size());
    const size_t dot = rest.find('.');
    if (dot == std::string::npos || dot > 9 || !whole_number(rest.substr(0, dot)) || !whole_number(rest.substr(dot + 1)))
      continue;
    const long pid = std::strtol(rest.c_str(), nullptr, 10);
    if (pid == ::getpid() || ::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    std::error_code ignored;
    fs::remove(it->path(), ignored);
  }
}

}  // namespace

void save_safetensors(const std::string& path, const OrderedDict<Tensor>& tensors, const Metadata& metadata,
                      const PartialWriteHook& hook) {
  check(metadata.count(kChecksumKey) == 0, "save_safetensors('{}'): metadata key '{}' is reserved", path,
        kChecksumKey);
  // Everything to host bytes first, so a bad tensor fails before any file exists.
  json header = json::object();
  std::vector<uint8_t> data;
  for (const auto& [name, t] : tensors) {
    check(!name.empty() && name != "__metadata__", "save_safetensors('{}'): invalid tensor name '{}'", path, name);
    check_utf8(path, name, "tensor name");
    check(t.defined(), "save_safetensors('{}'): tensor '{}' is undefined", path, name);
    const Tensor host = prim::contiguous(prim::to(t, kCPU));
    const size_t begin = data.size();
    data.resize(begin + host.nbytes());
    if (host.nbytes() > 0) std::memcpy(data.data() + begin, host.data_ptr(), host.nbytes());
    header[name] = {{"dtype", format_dtype(t.dtype())}, {"shape", t.shape()}, {"data_offsets", {begin, data.size()}}};
  }
  json meta = json::object();
  for (const auto& [k, v] : metadata) {
    check_utf8(path, k, "metadata key");
    check_utf8(path, v, "metadata value");
    meta[k] = v;
  }
  header["__metadata__"] = meta;
  const uint32_t crc = checksum(header, data);
  header["__metadata__"][kChecksumKey] = hex32(crc);

  const std::string text = header_text(header);
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));

  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const std::string temp = (dir / temporary_name(target.filename().string())).string();
  remove_stale_temporaries(dir, target.filename().string());
  try {
    OutputFile out(temp);
    out.write(length, 8);
    out.write(text.data(), text.size());
    const size_t half = data.size() / 2;
    out.write(data.data(), half);
    if (hook) hook(temp);
    out.write(data.data() + half, data.size() - half);
    out.sync_and_close();
    std::error_code ec;
    fs::rename(temp, target, ec);
    check<IOError>(!ec, "save_safetensors: cannot rename '{}' to '{}': {}", temp, path, ec.message());
  } catch (...) {
    std::error_code ignored;
    fs::remove(temp, ignored);
    throw;
  }
  sync_directory(dir.string());
}

TensorFile load_safetensors(const std::string& path) {
  std::error_code ec;
  check<IOError>(std::filesystem::is_regular_file(path, ec), "load_safetensors: '{}' is not a file{}", path,
                 ec ? fmt::format(" ({})", ec.message()) : std::string());
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  check<IOError>(in.good(), "load_safetensors: cannot open '{}'", path);
  const uint64_t file_size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  check<IOError>(file_size >= 8, "load_safetensors: '{}' has {} bytes, too short for the 8-byte header length", path,
                 file_size);
  uint8_t length_bytes[8];
  in.read(reinterpret_cast<char*>(length_bytes), 8);
  check<IOError>(in.gcount() == 8, "load_safetensors: cannot read the header length of '{}'", path);
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= static_cast<uint64_t>(length_bytes[i]) << (8 * i);
  check<IOError>(header_len >= 2 && header_len <= kMaxHeaderBytes && header_len <= file_size - 8,
                 "load_safetensors: '{}' declares a {}-byte header, but the file has {} bytes (truncated or not a "
                 "safetensors file)",
                 path, header_len, file_size);
  std::string text(header_len, '\0');
  in.read(text.data(), static_cast<std::streamsize>(header_len));
  std::vector<uint8_t> data(file_size - 8 - header_len);
  in.read(reinterpret_cast<char*>(data.data()), static_cast<std::streamsize>(data.size()));
  check<IOError>(in.good(), "load_safetensors: reading '{}' failed", path);

  // A safetensors header nests three levels: the header, a tensor's entry
  // (or the metadata), and a shape or its offsets. Anything deeper is no
  // such file, and nlohmann's dump() (messages, the checksum) recurses, so a
  // header of a million nested brackets would overflow the stack.
  constexpr int kMaxNesting = 2;
  auto shallow = [&](int depth, json::parse_event_t event, json&) {
    if ((event == json::parse_event_t::object_start || event == json::parse_event_t::array_start) &&
        depth > kMaxNesting)
      throw IOError(fmt::format("load_safetensors: '{}' is not a safetensors file: its header nests deeper than a "
                                "tensor's shape",
                                path));
    return true;
  };
  json header;
  try {
    header = json::parse(text, shallow);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number beyond double
    throw IOError(fmt::format("load_safetensors: '{}' has a malformed JSON header: {}", path, e.what()));
  }
  check<IOError>(header.is_object(), "load_safetensors: '{}': the header is not a JSON object", path);

  TensorFile result;
  std::optional<std::string> stored_crc;
  if (auto m = header.find("__metadata__"); m != header.end()) {
    check<IOError>(m->is_object(), "load_safetensors: '{}': __metadata__ is not an object", path);
    for (const auto& [k, v] : m->items()) {
      check<IOError>(v.is_string(), "load_safetensors: '{}': metadata '{}' is not a string", path, k);
      if (k == kChecksumKey)
        stored_crc = v.get<std::string>();
      else
        result.metadata[k] = v.get<std::string>();
    }
  }

  struct Entry {
    std::string name;
    DType dtype;
    Shape shape;
    uint64_t begin, end;
  };
  std::vector<Entry> entries;
  for (const auto& item : header.items()) {
    const std::string& name = item.key();  // named, not bound: the fault lambda captures it
    const json& e = item.value();
    if (name == "__metadata__") continue;
    auto fault = [&](const std::string& what) {
      return IOError(fmt::format("load_safetensors: '{}', tensor '{}': {}", path, name, what));
    };
    if (!e.is_object() || e.size() != 3 || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
      throw fault("entry needs dtype, shape and data_offsets, and nothing else");
    const json& dt = e["dtype"];
    const std::optional<DType> dtype = dt.is_string() ? parse_dtype(dt.get<std::string>()) : std::nullopt;
    if (!dtype) throw fault(fmt::format("unsupported dtype {}", brief(dt)));
    Shape shape;
    // count: the elements, which the file must hold; extent: the product of
    // the non-zero sizes, which the strides are made of (a zero-size tensor
    // holds nothing, but its strides must still fit in int64).
    uint64_t count = 1, extent = 1;
    constexpr uint64_t kMaxExtent = uint64_t{1} << 62;
    if (!e["shape"].is_array()) throw fault("shape is not an array");
    if (e["shape"].size() > static_cast<size_t>(kMaxDims))
      throw fault(fmt::format("shape {} has {} dimensions; at most {} are supported", brief(e["shape"]),
                              e["shape"].size(), kMaxDims));
    for (const json& d : e["shape"]) {
      if (!d.is_number_unsigned()) throw fault(fmt::format("shape {} is not a list of sizes", brief(e["shape"])));
      const uint64_t s = d.get<uint64_t>();
      if (s > 0 && extent > kMaxExtent / s)
        throw fault(fmt::format("shape {} has sizes whose product exceeds 2^62", brief(e["shape"])));
      if (s > 0 && count > file_size / s) throw fault(fmt::format("shape {} is larger than the file", brief(e["shape"])));
      extent *= s > 0 ? s : 1;
      count *= s;
      shape.push_back(static_cast<int64_t>(s));
    }
    const json& off = e["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      throw fault(fmt::format("data_offsets {} must be [begin, end]", brief(off)));
    const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (begin > end || end > data.size())
      throw fault(fmt::format("data_offsets [{}, {}] outside the {} data bytes the file holds{}", begin, end,
                              data.size(), end > data.size() ? " (truncated?)" : ""));
    if (end - begin != count * dtype_size(*dtype))
      throw fault(fmt::format("{} {} needs {} bytes, data_offsets [{}, {}] hold {}", dt.get<std::string>(),
                              brief(e["shape"]), count * dtype_size(*dtype), begin, end, end - begin));
    entries.push_back({name, *dtype, shape, begin, end});
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expected = 0;
  for (const Entry& e : entries) {
    check<IOError>(e.begin == expected,
                   "load_safetensors: '{}', tensor '{}': data_offsets [{}, {}] {} the previous tensor's end {}", path,
                   e.name, e.begin, e.end, e.begin < expected ? "overlap" : "leave a gap after", expected);
    expected = e.end;
  }
  check<IOError>(expected == data.size(),
                 "load_safetensors: '{}': the tensors hold {} bytes but the file has {} data bytes ({})", path,
                 expected, data.size(), expected < data.size() ? "extra bytes at the end" : "truncated");

  if (stored_crc) {
    // The checksum covers the header as parsed, and the parser passes over
    // bytes that change nothing (a NUL in the padding ends its input): a
    // header not laid out exactly as the writer lays it out is damaged too.
    check<IOError>(header_text(header) == text,
                   "load_safetensors: '{}' is corrupted: its header bytes are not those of the header they hold", path);
    header["__metadata__"].erase(kChecksumKey);
    const std::string actual = hex32(checksum(header, data));
    check<IOError>(actual == *stored_crc,
                   "load_safetensors: '{}' is corrupted: checksum {} does not match the stored {}", path, actual,
                   *stored_crc);
    result.had_checksum = true;
  }

  for (const Entry& e : entries) {
    Tensor t = Tensor::empty(e.shape, e.dtype, kCPU);
    if (e.end > e.begin) std::memcpy(t.data_ptr(), data.data() + e.begin, e.end - e.begin);
    result.tensors.insert(e.name, t);
  }
  return result;
}

}  // namespace mpt::io
