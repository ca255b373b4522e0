#pragma once
// The TCP store's wire format. The server opens every connection with a
// banner (below); after it, both directions carry messages:
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

// The server's first bytes on every connection, before it reads anything:
// "MPTSTORE" and the protocol version (u32). A client reads them before any
// message, so that another service at the address (an HTTP server, say) is
// named as such instead of having its reply parsed as a message, and a
// store of another mptrain version is told apart from both.
inline constexpr std::string_view kStoreMagic = "MPTSTORE";
// 2: the banner; 1 (no banner) was the protocol before it.
inline constexpr uint32_t kStoreProtocolVersion = 2;
inline constexpr size_t kStoreBannerBytes = kStoreMagic.size() + sizeof(uint32_t);
std::string store_banner(uint32_t version = kStoreProtocolVersion);
// A client's first message, the hello: this command, the protocol's name
// ("mpt-tcp-store-<version>") as its key and the job token as its value.
inline constexpr uint8_t kStoreHello = 5;
std::string store_protocol_name(uint32_t version = kStoreProtocolVersion);

// What the bytes a server sent first say, read one at a time: `more` until
// they are a whole banner or stop matching one. The version is set for
// `store` and `other_version`.
enum class BannerState { more, store, other_version, stranger };
BannerState read_store_banner(std::string_view first_bytes, uint32_t* version);

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
