// The TCP store's message parser on arbitrary bytes, read as a stream of
// messages the way the server reads a connection: each message parses and
// encodes back to exactly the bytes it came from, or the stream is refused
// with a DistributedError. Anything else is a finding.
#include <cstring>

#include "parallel/distributed_error.h"
#include "parallel/store_message.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view rest(reinterpret_cast<const char*>(data), size);
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
  return 0;
}
