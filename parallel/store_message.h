#pragma once
// The TCP store's wire format, both directions:
//   [u8 command or status][u32 key length][key][u32 value length][value]
// (lengths in host order: every rank of a job runs on the same kind of
// machine). The parsing lives here, apart from the sockets, so that it can be
// tested and fuzzed on plain bytes. A message that breaks the format or the
// limits below is a DistributedError naming what is wrong; a length is
// checked before anything is read for it, and a field grows only as its
// bytes arrive.
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "parallel/store.h"

namespace mpt::dist {

// Rendezvous keys are short names and values are addresses, ids and
// counters; the limits keep a stray or hostile peer from making the server
// allocate gigabytes from a 9-byte message.
inline constexpr size_t kMaxStoreKeyBytes = 4096;
inline constexpr size_t kMaxStoreValueBytes = size_t{64} << 20;

struct StoreMessage {
  uint8_t head = 0;  // a command (client to server) or a status (server to client)
  std::string key;
  Bytes value;
};

// Throws DistributedError naming `what` when key or value exceed the limits.
void check_store_limits(size_t key_bytes, size_t value_bytes, const std::string& what);

// The bytes of `msg` on the wire (limits checked).
std::string encode_store_message(const StoreMessage& msg, const std::string& what);

// Reads one message through `read_exact`, which must fill exactly n bytes or
// throw; lengths are checked against the limits before anything is read into.
using ReadExact = std::function<void(void* dst, size_t n)>;
StoreMessage read_store_message(const ReadExact& read_exact, const std::string& what);

// Parses one message from the front of `bytes`; *consumed receives its
// length. A message cut short is a DistributedError like any other fault.
StoreMessage parse_store_message(std::string_view bytes, size_t* consumed, const std::string& what);

}  // namespace mpt::dist
