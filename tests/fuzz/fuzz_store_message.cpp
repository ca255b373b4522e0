// The TCP store's parsers on arbitrary bytes. Read as a stream of messages
// the way the server reads a connection: each message parses and encodes
// back to exactly the bytes it came from, or the stream is refused with a
// DistributedError. Read as the start of a server's answer the way a client
// reads it, a byte at a time: the banner is decided within its length, and
// only the banner itself is taken for a store. Anything else is a finding.
#include <cstring>

#include "parallel/distributed_error.h"
#include "parallel/store_message.h"

namespace {

void read_as_server(std::string_view rest) {
  try {
    while (!rest.empty()) {
      size_t used = 0;
      const mpt::dist::StoreMessage msg = mpt::dist::parse_store_message(rest, &used, "fuzz");
      if (used == 0 || used > rest.size()) __builtin_trap();
      if (msg.key.size() > mpt::dist::kMaxStoreKeyBytes || msg.value.size() > mpt::dist::kMaxStoreValueBytes)
        __builtin_trap();
      if (mpt::dist::encode_store_message(msg, "fuzz") != rest.substr(0, used)) __builtin_trap();
      rest.remove_prefix(used);
    }
  } catch (const mpt::DistributedError&) {
  }
}

void read_as_client(std::string_view bytes) {
  using mpt::dist::BannerState;
  uint32_t version = 0;
  size_t n = 0;
  BannerState state;
  while ((state = mpt::dist::read_store_banner(bytes.substr(0, n), &version)) == BannerState::more) {
    if (n >= mpt::dist::kStoreBannerBytes) __builtin_trap();
    if (n == bytes.size()) return;
    ++n;
  }
  if (n > mpt::dist::kStoreBannerBytes) __builtin_trap();
  if (state == BannerState::store && bytes.substr(0, n) != mpt::dist::store_banner()) __builtin_trap();
  if (state == BannerState::other_version &&
      (n != mpt::dist::kStoreBannerBytes || version == mpt::dist::kStoreProtocolVersion))
    __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  read_as_server(bytes);
  read_as_client(bytes);
  return 0;
}
