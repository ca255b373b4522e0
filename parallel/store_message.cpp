#include "parallel/store_message.h"

#include <algorithm>
#include <cstring>

#include "parallel/distributed_error.h"

namespace mpt::dist {

void check_store_limits(size_t key_bytes, size_t value_bytes, const std::string& what) {
  check<DistributedError>(key_bytes <= kMaxStoreKeyBytes, "{}: a key of {} bytes is over the store's limit of {}",
                          what, key_bytes, kMaxStoreKeyBytes);
  check<DistributedError>(value_bytes <= kMaxStoreValueBytes,
                          "{}: a value of {} bytes is over the store's limit of {}", what, value_bytes,
                          kMaxStoreValueBytes);
}

std::string store_banner(uint32_t version) {
  std::string out(kStoreMagic);
  return out.append(reinterpret_cast<const char*>(&version), sizeof version);
}

std::string store_protocol_name(uint32_t version) { return fmt::format("mpt-tcp-store-{}", version); }

BannerState read_store_banner(std::string_view first_bytes, uint32_t* version) {
  const size_t n = std::min(first_bytes.size(), kStoreMagic.size());
  if (first_bytes.substr(0, n) != kStoreMagic.substr(0, n)) return BannerState::stranger;
  if (first_bytes.size() < kStoreBannerBytes) return BannerState::more;
  std::memcpy(version, first_bytes.data() + kStoreMagic.size(), sizeof *version);
  return *version == kStoreProtocolVersion ? BannerState::store : BannerState::other_version;
}

std::string encode_store_message(const StoreMessage& msg, const std::string& what) {
  check_store_limits(msg.key.size(), msg.value.size(), what);
  const uint32_t klen = static_cast<uint32_t>(msg.key.size()), vlen = static_cast<uint32_t>(msg.value.size());
  std::string out(1, static_cast<char>(msg.head));
  out.append(reinterpret_cast<const char*>(&klen), 4).append(msg.key);
  out.append(reinterpret_cast<const char*>(&vlen), 4).append(msg.value.begin(), msg.value.end());
  return out;
}

namespace {

// Reads a field of `len` bytes into *out, growing it as the bytes arrive
// (doubling from 64 KiB): a message that declares a large value and then
// ends costs only what it sent.
template <typename Buffer>
void read_field(const ReadExact& read_exact, Buffer* out, size_t len) {
  constexpr size_t kFirstChunk = size_t{1} << 16;
  size_t got = 0;
  while (got < len) {
    const size_t chunk = std::min(len - got, std::max(got, kFirstChunk));
    out->resize(got + chunk);
    read_exact(out->data() + got, chunk);
    got += chunk;
  }
}

}  // namespace

StoreMessage read_store_message(const ReadExact& read_exact, const std::string& what) {
  StoreMessage msg;
  read_exact(&msg.head, 1);
  uint32_t len = 0;
  read_exact(&len, 4);
  check_store_limits(len, 0, what);
  read_field(read_exact, &msg.key, len);
  read_exact(&len, 4);
  check_store_limits(msg.key.size(), len, what);
  read_field(read_exact, &msg.value, len);
  return msg;
}

StoreMessage parse_store_message(std::string_view bytes, size_t* consumed, const std::string& what) {
  size_t pos = 0;
  StoreMessage msg = read_store_message(
      [&](void* dst, size_t n) {
        check<DistributedError>(n <= bytes.size() - pos,
                                "{}: the message ends after {} bytes; {} more were expected at offset {}", what,
                                bytes.size(), n, pos);
        std::memcpy(dst, bytes.data() + pos, n);
        pos += n;
      },
      what);
  *consumed = pos;
  return msg;
}

}  // namespace mpt::dist
