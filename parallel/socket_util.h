#pragma once
// Thin, checked wrappers over POSIX TCP sockets for the store. Every call
// that can block is bounded by a timeout; every failure is an mpt::Error
// naming the address and port.
#include <sys/socket.h>

#include <cstddef>
#include <string>

#include "parallel/store.h"

namespace mpt::dist {

// Listens at `port` (0: any free port) on `bind_address` (a name or numeric
// address; empty: all interfaces). Returns the socket; *bound_port receives
// the actual port. DistributedError if the port is busy or the address is
// not one of this host's.
int listen_tcp(int port, int* bound_port, const std::string& bind_address = "");
// Connects to host:port, retrying refused or unreachable attempts until
// `timeout`; TimeoutError names host, port, the time waited and the last error.
int connect_tcp(const std::string& host, int port, Millis timeout);
// Bounds every later send/recv on `fd` by `timeout`.
void set_io_timeout(int fd, Millis timeout);
// Whole-buffer I/O; DistributedError (or TimeoutError) with `what` in the message.
void send_all(int fd, const void* data, size_t n, const std::string& what);
void recv_all(int fd, void* data, size_t n, const std::string& what);
void close_fd(int fd);
// A socket address's numeric text, an IPv4 client of a dual-stack socket
// ("::ffff:10.0.0.2") shown as the IPv4 address it is; "" for other families.
std::string address_text(const sockaddr_storage& addr);
int port_of(const sockaddr_storage& addr);  // 0 for other families
// The numeric address (IPv4 or IPv6) of this end of a connected socket;
// "" where it cannot be told.
std::string local_address_of(int fd);
// Whether a numeric address is a loopback one (127.0.0.0/8, ::1).
bool is_loopback(const std::string& address);

}  // namespace mpt::dist
