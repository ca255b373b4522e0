#include "parallel/loopback_stores.h"

#include "parallel/tcp_store.h"
#include "tensor/error.h"

namespace mpt::dist {

std::vector<std::shared_ptr<Store>> loopback_stores(int world, Millis timeout) {
  check<ValueError>(world >= 1, "loopback_stores: world size must be at least 1, got {}", world);
  const TcpStoreOptions options{.bind_address = "127.0.0.1", .job_token = random_job_token()};
  auto master = std::make_shared<TcpStore>("127.0.0.1", 0, true, timeout, options);
  std::vector<std::shared_ptr<Store>> stores{master};
  for (int r = 1; r < world; ++r)
    stores.push_back(std::make_shared<TcpStore>("127.0.0.1", master->port(), false, timeout, options));
  return stores;
}

}  // namespace mpt::dist
