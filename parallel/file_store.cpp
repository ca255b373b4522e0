#include "parallel/file_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>

#include "parallel/distributed_error.h"

namespace mpt::dist {

namespace fs = std::filesystem;

FileStore::FileStore(std::string folder, Millis timeout) : Store(timeout), folder_(std::move(folder)) {
  mpt::check<ValueError>(!folder_.empty(), "FileStore: empty folder path");
  std::error_code ec;
  fs::create_directories(folder_, ec);
  mpt::check<IOError>(!ec && fs::is_directory(folder_), "FileStore: cannot create or use folder '{}': {}", folder_,
                 ec.message());
}

// Keys may hold '/', so the file name is the key in hex.
std::string FileStore::path_of(const std::string& key) const {
  std::string name = "k";
  for (unsigned char c : key) name += fmt::format("{:02x}", c);
  return folder_ + "/" + name;
}

namespace {

void write_atomically(const std::string& path, const Bytes& value) {
  // The temporary is this write's alone: threads of one process setting one
  // key at once must not write into each other's file.
  static std::atomic<uint64_t> writes{0};
  const std::string tmp = fmt::format("{}.tmp.{}.{}", path, ::getpid(), writes.fetch_add(1));
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(value.data(), static_cast<std::streamsize>(value.size()));
    mpt::check<IOError>(static_cast<bool>(out), "FileStore: cannot write '{}'", tmp);
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  mpt::check<IOError>(!ec, "FileStore: cannot rename '{}' to '{}': {}", tmp, path, ec.message());
}

// Whether a key's file is there; an error other than its absence (a
// folder gone unreadable, say) is an IOError, not a filesystem_error.
bool exists(const std::string& path) {
  std::error_code ec;
  const bool there = fs::exists(path, ec);
  mpt::check<IOError>(!ec, "FileStore: cannot look for '{}': {}", path, ec.message());
  return there;
}

Bytes read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  mpt::check<IOError>(static_cast<bool>(in), "FileStore: cannot read '{}'", path);
  return Bytes(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

void FileStore::set(const std::string& key, const Bytes& value) { write_atomically(path_of(key), value); }

Bytes FileStore::get(const std::string& key) {
  wait({key});
  return read_file(path_of(key));
}

int64_t FileStore::add(const std::string& key, int64_t delta) {
  // Read-modify-write under an exclusive lock on one lock file, which every
  // rank sharing the folder takes; waiting for it is bounded like any wait.
  const std::string lock_path = folder_ + "/.lock";
  const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  mpt::check<IOError>(fd >= 0, "FileStore: cannot open '{}': {}", lock_path, std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }  // closing releases the lock too
  } closer{fd};
  // Elapsed time against the timeout, in milliseconds: a deadline of now()
  // plus a timeout of years would overflow the clock's nanoseconds.
  const auto start = std::chrono::steady_clock::now();
  while (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    mpt::check<IOError>(err == EWOULDBLOCK || err == EINTR, "FileStore: cannot lock '{}': {}", lock_path,
                        std::strerror(err));
    mpt::check<TimeoutError>(std::chrono::duration_cast<Millis>(std::chrono::steady_clock::now() - start) < timeout(),
                             "FileStore: '{}' stayed locked by another process for the timeout ({} ms)", lock_path,
                             timeout().count());
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const std::string path = path_of(key);
  int64_t value = 0;
  if (exists(path)) {
    const Bytes b = read_file(path);
    mpt::check<DistributedError>(b.size() == sizeof value, "FileStore: key '{}' holds {} bytes, not a counter", key,
                                 b.size());
    std::memcpy(&value, b.data(), sizeof value);
  }
  mpt::check<ValueError>(!__builtin_add_overflow(value, delta, &value),
                         "FileStore: adding {} to key '{}' overflows int64", delta, key);
  Bytes out(sizeof value);
  std::memcpy(out.data(), &value, sizeof value);
  write_atomically(path, out);
  return value;
}

bool FileStore::check(const std::vector<std::string>& keys) {
  for (const auto& k : keys)
    if (!exists(path_of(k))) return false;
  return true;
}

}  // namespace mpt::dist
