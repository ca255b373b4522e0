// The TCP store's wire format and what the server does with messages that
// break it: oversized keys and values, messages cut short, commands it does
// not know, counters that are not counters. Each is refused with a message
// naming the problem, and the server keeps serving everyone else.
#include <chrono>
#include <cstring>

#include "parallel/distributed_error.h"
#include "parallel/socket_util.h"
#include "parallel/store_message.h"
#include "parallel/tcp_store.h"
#include "test_util.h"

using namespace mpt;
using namespace mpt::dist;
using mpt::testing::error_of;
using mpt::testing::expect_contains;
using std::chrono::milliseconds;

namespace {

std::string header(uint8_t head, uint32_t key_len) {
  std::string out(1, static_cast<char>(head));
  return out.append(reinterpret_cast<const char*>(&key_len), 4);
}

std::string length(uint32_t n) { return std::string(reinterpret_cast<const char*>(&n), 4); }

}  // namespace

TEST(StoreMessage, RoundTripsAndReportsItsLength) {
  const StoreMessage msg{3, "mpt/rank_claims/1", Bytes{0, '\xff', 7}};
  const std::string wire = encode_store_message(msg, "test") + "next";
  size_t used = 0;
  const StoreMessage back = parse_store_message(wire, &used, "test");
  EXPECT_EQ(used, wire.size() - 4);
  EXPECT_EQ(back.head, 3);
  EXPECT_EQ(back.key, msg.key);
  EXPECT_EQ(back.value, msg.value);
}

TEST(StoreMessage, MessagesCutShortAreRefusedAtEveryLength) {
  const std::string wire = encode_store_message({1, "key", Bytes{'v', 'a', 'l'}}, "test");
  for (size_t n = 0; n < wire.size(); ++n) {
    size_t used = 0;
    const std::string msg =
        error_of<DistributedError>([&] { parse_store_message(std::string_view(wire).substr(0, n), &used, "test"); });
    expect_contains(msg, {fmt::format("the message ends after {} bytes", n)});
  }
}

TEST(StoreMessage, OversizedKeysAndValuesAreRefusedBeforeAllocating) {
  size_t used = 0;
  // Only the header is there: the length alone must be enough to refuse.
  const std::string big_key = header(1, 0xffffffffu);
  expect_contains(error_of<DistributedError>([&] { parse_store_message(big_key, &used, "probe"); }),
                  {"probe: a key of 4294967295 bytes is over the store's limit of 4096"});
  const std::string big_value = header(1, 1) + "k" + length(uint32_t(kMaxStoreValueBytes + 1));
  expect_contains(error_of<DistributedError>([&] { parse_store_message(big_value, &used, "probe"); }),
                  {fmt::format("a value of {} bytes is over the store's limit of {}", kMaxStoreValueBytes + 1,
                               kMaxStoreValueBytes)});
  // The limits themselves are accepted.
  const StoreMessage at_limit{1, std::string(kMaxStoreKeyBytes, 'k'), Bytes(16)};
  const StoreMessage back = parse_store_message(encode_store_message(at_limit, "test"), &used, "test");
  EXPECT_EQ(back.key.size(), kMaxStoreKeyBytes);
}

TEST(TcpStore, ClientRefusesAnOversizedKeyNamingItsSize) {
  TcpStore master("127.0.0.1", 0, true, milliseconds(5000));
  const std::string key(kMaxStoreKeyBytes + 1, 'k');
  const std::string msg = error_of<DistributedError>([&] { master.set(key, Bytes{'v'}); });
  expect_contains(msg, {"a key of 4097 bytes is over the store's limit of 4096"});
  expect_contains(msg, {"(4097 bytes)"});  // the key itself is shown cut short
  master.set("fine", Bytes{'o', 'k'});
  EXPECT_EQ(master.get_string("fine"), "ok");
}

TEST(TcpStore, AddOnAValueThatIsNotACounterIsRefused) {
  TcpStore master("127.0.0.1", 0, true, milliseconds(5000));
  master.set("name", Bytes{'h', 'e', 'l', 'l', 'o'});
  expect_contains(error_of<DistributedError>([&] { master.add("name", 1); }),
                  {"the server refused the request: add on key 'name': the key holds 5 bytes, not an 8-byte counter"});
  EXPECT_EQ(master.add("n", INT64_MAX), INT64_MAX);
  expect_contains(error_of<DistributedError>([&] { master.add("n", 1); }), {"the sum overflows 64 bits"});
  EXPECT_EQ(master.add("n", -1), INT64_MAX - 1);  // the connection is still in step
}

TEST(StoreMessage, TheBannerTellsAStoreFromAStrangerByItsFirstByteThatDiffers) {
  const std::string banner = store_banner();
  ASSERT_EQ(banner.size(), kStoreBannerBytes);
  uint32_t version = 0;
  for (size_t n = 0; n < banner.size(); ++n)
    EXPECT_EQ(read_store_banner(std::string_view(banner).substr(0, n), &version), BannerState::more) << n;
  EXPECT_EQ(read_store_banner(banner, &version), BannerState::store);
  EXPECT_EQ(version, kStoreProtocolVersion);
  EXPECT_EQ(read_store_banner(store_banner(7), &version), BannerState::other_version);
  EXPECT_EQ(version, 7u);
  EXPECT_EQ(read_store_banner("H", &version), BannerState::stranger);
  EXPECT_EQ(read_store_banner("MPTSTORX", &version), BannerState::stranger);
  EXPECT_EQ(store_protocol_name(), "mpt-tcp-store-2");
}

// The banner every connection to a store starts with, read off `fd`.
static void expect_banner(int fd) {
  std::string banner(kStoreBannerBytes, '\0');
  recv_all(fd, banner.data(), banner.size(), "raw client");
  EXPECT_EQ(banner, store_banner());
}

TEST(TcpStore, ServerRefusesMalformedMessagesAndKeepsServingOthers) {
  TcpStore master("127.0.0.1", 0, true, milliseconds(5000));
  master.set("kept", Bytes{'v', 'a', 'l', 'u', 'e'});
  const auto reply_to = [&](const std::string& bytes) {
    const int fd = connect_tcp("127.0.0.1", master.port(), milliseconds(5000));
    set_io_timeout(fd, milliseconds(5000));
    send_all(fd, bytes.data(), bytes.size(), "raw client");
    expect_banner(fd);
    const StoreMessage reply =
        read_store_message([&](void* dst, size_t n) { recv_all(fd, dst, n, "raw client"); }, "raw client");
    // After a malformed message the server ends the connection.
    char extra;
    const std::string closed = error_of<DistributedError>([&] { recv_all(fd, &extra, 1, "raw client"); });
    close_fd(fd);
    expect_contains(closed, {"closed the connection"});
    return reply;
  };
  StoreMessage r = reply_to(header(1, 0x7fffffffu));
  EXPECT_EQ(r.head, 3);
  expect_contains(std::string(r.value.begin(), r.value.end()),
                  {"TcpStore server: a key of 2147483647 bytes is over the store's limit of 4096"});
  r = reply_to(header(1, 1) + "k" + length(0xfffffff0u));
  expect_contains(std::string(r.value.begin(), r.value.end()), {"a value of 4294967280 bytes is over"});
  // An unknown command is understood as such and does not end the
  // connection (once the connection is admitted: hello with the protocol
  // name and this job's token, empty here; the banner comes first).
  const int fd = connect_tcp("127.0.0.1", master.port(), milliseconds(5000));
  set_io_timeout(fd, milliseconds(5000));
  const std::string hello = encode_store_message({kStoreHello, store_protocol_name(), {}}, "raw client");
  send_all(fd, hello.data(), hello.size(), "raw client");
  expect_banner(fd);
  const StoreMessage welcome =
      read_store_message([&](void* dst, size_t n) { recv_all(fd, dst, n, "raw client"); }, "raw client");
  ASSERT_EQ(welcome.head, 1);
  const std::string unknown = encode_store_message({99, "kept", {}}, "raw client");
  for (int i = 0; i < 2; ++i) {
    send_all(fd, unknown.data(), unknown.size(), "raw client");
    const StoreMessage reply =
        read_store_message([&](void* dst, size_t n) { recv_all(fd, dst, n, "raw client"); }, "raw client");
    EXPECT_EQ(reply.head, 2);
  }
  close_fd(fd);
  EXPECT_EQ(master.get_string("kept"), "value");
}
