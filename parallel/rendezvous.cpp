#include "parallel/rendezvous.h"

#include <arpa/inet.h>

#include <algorithm>
#include <charconv>
#include <thread>
#include <cstdlib>

#include <fmt/ranges.h>

#include "parallel/distributed_error.h"
#include "parallel/file_store.h"
#include "parallel/tcp_store.h"

namespace mpt::dist {

std::optional<std::string> process_env(const std::string& name) {
  const char* v = std::getenv(name.c_str());
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

namespace {

struct Found {
  std::string name;
  std::string value;
};

// The first of `names` that is set.
std::optional<Found> first_set(const EnvLookup& env, std::initializer_list<const char*> names) {
  for (const char* n : names)
    if (auto v = env(n)) return Found{n, *v};
  return std::nullopt;
}

int parse_int(const Found& f) {
  // Slurm writes per-node counts as "2(x3)": the leading number is ours.
  int value = 0;
  const char* begin = f.value.data();
  const char* end = begin + f.value.size();
  auto [ptr, ec] = std::from_chars(begin, end, value);
  // The whole rest must be the repeat count, "(x<count>)".
  const std::string_view rest(ptr, static_cast<size_t>(end - ptr));
  const bool slurm_repeat = f.name.rfind("SLURM_", 0) == 0 && ptr != begin && rest.size() >= 4 &&
                            rest.substr(0, 2) == "(x" && rest.back() == ')' &&
                            rest.substr(2, rest.size() - 3).find_first_not_of("0123456789") == std::string_view::npos;
  check<ValueError>(ec == std::errc() && ptr != begin && (ptr == end || slurm_repeat),
                    "rendezvous: {}='{}' is not an integer", f.name, f.value);
  return value;
}

bool is_numeric_address(const std::string& host) {
  in6_addr v6{};
  in_addr v4{};
  return ::inet_pton(AF_INET, host.c_str(), &v4) == 1 || ::inet_pton(AF_INET6, host.c_str(), &v6) == 1;
}

}  // namespace

RendezvousConfig config_from_env(const EnvLookup& env, bool need_master) {
  RendezvousConfig c;
  const auto rank = first_set(env, {"RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"});
  check<ValueError>(rank.has_value(),
                    "rendezvous: RANK is not set (nor OMPI_COMM_WORLD_RANK from mpirun, nor SLURM_PROCID from "
                    "srun); start the job with mpt-run, torchrun, mpirun or srun, or export RANK");
  const auto world = first_set(env, {"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"});
  check<ValueError>(world.has_value(),
                    "rendezvous: WORLD_SIZE is not set (nor OMPI_COMM_WORLD_SIZE from mpirun, nor SLURM_NTASKS "
                    "from srun); export WORLD_SIZE, the total number of processes");
  c.launcher = rank->name == "RANK" ? "torchrun" : rank->name.rfind("OMPI_", 0) == 0 ? "Open MPI" : "Slurm";
  c.rank = parse_int(*rank);
  c.world_size = parse_int(*world);
  check<ValueError>(c.world_size >= 1, "rendezvous: {}={} must be at least 1", world->name, c.world_size);
  check<ValueError>(c.rank >= 0 && c.rank < c.world_size, "rendezvous: {}={} is outside 0..{} ({}={})",
                    rank->name, c.rank, c.world_size - 1, world->name, c.world_size);

  const auto local_rank = first_set(env, {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"});
  const auto local_size =
      first_set(env, {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"});
  c.local_rank = local_rank ? parse_int(*local_rank) : c.rank;
  c.local_world_size = local_size ? parse_int(*local_size) : c.world_size;
  check<ValueError>(c.local_world_size >= 1 && c.local_rank >= 0 && c.local_rank < c.local_world_size,
                    "rendezvous: local rank {} is outside 0..{} (from {} and {})", c.local_rank,
                    c.local_world_size - 1, local_rank ? local_rank->name : "RANK",
                    local_size ? local_size->name : "WORLD_SIZE");

  if (need_master) {
    const auto addr = env("MASTER_ADDR");
    check<ValueError>(addr.has_value() && !addr->empty(),
                      "rendezvous env://: MASTER_ADDR is not set (the host of rank 0, e.g. 127.0.0.1 on one "
                      "machine; under Slurm, the first host of $SLURM_JOB_NODELIST)");
    const auto port = env("MASTER_PORT");
    check<ValueError>(port.has_value() && !port->empty(),
                      "rendezvous env://: MASTER_PORT is not set (a free TCP port on rank 0's host, e.g. 29500)");
    c.master_addr = *addr;
    c.master_port = parse_int({"MASTER_PORT", *port});
    check<ValueError>(c.master_port > 0 && c.master_port <= 65535, "rendezvous: MASTER_PORT={} is outside 1..65535",
                      c.master_port);
  }
  // A numeric MASTER_ADDR is where the others connect, so the store need
  // listen nowhere else; a host name may resolve to a loopback alias on its
  // own host (Debian's 127.0.1.1), so then it listens on every interface.
  if (auto bind = env("MPT_STORE_BIND_ADDR"))
    c.store_bind_address = *bind;
  else if (is_numeric_address(c.master_addr))
    c.store_bind_address = c.master_addr;
  c.job_token = env("MPT_JOB_TOKEN").value_or("");
  return c;
}

namespace {

std::string alive_key(int rank) { return fmt::format("mpt/alive/{}", rank); }
std::string gave_up_key(int rank) { return fmt::format("mpt/gave_up/{}", rank); }
std::string finished_key(const std::string& scope, int rank) { return fmt::format("{}finished/{}", scope, rank); }

// Adds `value` to a counter of the TcpStore within `grace`; a store out of
// reach means there is nobody to tell.
void add_if_reachable(Store& store, const std::string& key, int64_t value, Millis grace) {
  auto* tcp = dynamic_cast<TcpStore*>(&store);
  if (tcp == nullptr) return;
  try {
    tcp->add_within(key, value, grace);
  } catch (const std::exception&) {
  }
}

}  // namespace

std::vector<int> departed_ranks(Store& store, int world_size, std::optional<Millis> timeout) {
  auto* tcp = dynamic_cast<TcpStore*>(&store);
  if (tcp == nullptr) return {};
  std::vector<std::pair<int64_t, int>> gone;
  for (int r = 0; r < world_size; ++r)
    if (const int64_t order = tcp->departure_order(alive_key(r), timeout); order > 0) gone.emplace_back(order, r);
  std::sort(gone.begin(), gone.end());
  std::vector<int> ranks;
  for (const auto& [order, r] : gone) ranks.push_back(r);
  return ranks;
}

std::string describe_departures(Store& store, int world_size, Millis grace) {
  // Each question to the store waits at most `grace`: a store out of reach
  // must not stretch the failure. (Lowering the store's own timeout instead
  // would race with the other threads that use it.)
  try {
    const auto until = std::chrono::steady_clock::now() + grace;
    auto* tcp = dynamic_cast<TcpStore*>(&store);
    for (;;) {
      std::vector<int> gone, gave_up;
      for (int r : departed_ranks(store, world_size, grace))
        (tcp && tcp->add_within(gave_up_key(r), 0, grace) > 0 ? gave_up : gone).push_back(r);
      const std::string after = gave_up.empty() ? ""
                                                : fmt::format("; rank{} {} ended at {} own timeout{}",
                                                              gave_up.size() > 1 ? "s" : "", fmt::join(gave_up, ", "),
                                                              gave_up.size() > 1 ? "their" : "its",
                                                              gave_up.size() > 1 ? "s" : "");
      if (!gone.empty()) {
        std::string text = fmt::format("rank {} left the job first (its process exited or died)", gone.front());
        if (gone.size() > 1)
          text += fmt::format(", then rank{} {}", gone.size() > 2 ? "s" : "",
                              fmt::join(gone.begin() + 1, gone.end(), ", "));
        return text + after;
      }
      if (std::chrono::steady_clock::now() >= until) return "the store saw no rank leave" + after;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  } catch (const std::exception& e) {
    return fmt::format("the store at {} is unreachable too, so rank 0, its host, left the job (or the network to it "
                       "broke): {}",
                       store.describe(), e.what());
  }
}

void note_gave_up(Store& store, int rank, Millis grace) { add_if_reachable(store, gave_up_key(rank), 1, grace); }

void note_finished(Store& store, const std::string& scope, int rank, Millis grace) {
  add_if_reachable(store, finished_key(scope, rank), 1, grace);
}

void linger_for_departures(Store& store, const std::string& scope, int rank, int world_size, Millis grace) {
  auto* tcp = dynamic_cast<TcpStore*>(&store);
  if (tcp == nullptr || !tcp->hosts_server()) return;
  const auto until = std::chrono::steady_clock::now() + grace;
  try {
    while (std::chrono::steady_clock::now() < until) {
      const std::vector<int> gone = departed_ranks(store, world_size, grace);
      int done = 0;
      for (int r = 0; r < world_size; ++r)
        if (r != rank && (std::find(gone.begin(), gone.end(), r) != gone.end() ||
                          tcp->add_within(finished_key(scope, r), 0, grace) > 0))
          ++done;
      if (done >= world_size - 1) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  } catch (const std::exception&) {
    // Nothing to wait for if our own store cannot answer.
  }
}

void join_world(Store& store, int rank, int world_size) {
  const int64_t claims = store.add(fmt::format("mpt/rank_claims/{}", rank), 1);
  check<DistributedError>(claims == 1,
                          "rendezvous at {}: {} processes claim rank {}; every process needs its own RANK",
                          store.describe(), claims, rank);
  // Held as long as this process's store connection: when it dies, the
  // store knows, and the survivors' errors can name it.
  if (auto* tcp = dynamic_cast<TcpStore*>(&store)) tcp->set_ephemeral(alive_key(rank), Bytes{});
  store.set(fmt::format("mpt/arrived/{}", rank), std::to_string(world_size));

  const auto start = std::chrono::steady_clock::now();
  std::vector<int> arrived;
  for (int r = 0; r < world_size; ++r) {
    const std::string key = fmt::format("mpt/arrived/{}", r);
    const auto waited = std::chrono::duration_cast<Millis>(std::chrono::steady_clock::now() - start);
    try {
      store.wait({key}, std::max(Millis(1), store.timeout() - waited));
    } catch (const TimeoutError&) {
      std::vector<int> missing;
      for (int q = r; q < world_size; ++q) {
        if (store.check({fmt::format("mpt/arrived/{}", q)})) arrived.push_back(q);
        else missing.push_back(q);
      }
      const auto total = std::chrono::duration_cast<Millis>(std::chrono::steady_clock::now() - start);
      throw TimeoutError(fmt::format(
          "rendezvous at {}: rank {} waited {} ms (timeout {} ms) for {} ranks; arrived: {}; missing: {}",
          store.describe(), rank, total.count(), store.timeout().count(), world_size, arrived, missing));
    }
    const std::string their_size = store.get_string(key);
    check<DistributedError>(their_size == std::to_string(world_size),
                            "rendezvous at {}: world sizes disagree: rank {} says WORLD_SIZE={}, rank {} (this "
                            "one) says {}",
                            store.describe(), r, their_size, rank, world_size);
    arrived.push_back(r);
  }
}

Rendezvous rendezvous(const std::string& url, Millis timeout, const EnvLookup& env) {
  Rendezvous rv;
  if (url == "env://") {
    rv.config = config_from_env(env, true);
    rv.store = std::make_shared<TcpStore>(rv.config.master_addr, rv.config.master_port, rv.config.rank == 0, timeout,
                                          TcpStoreOptions{rv.config.store_bind_address, rv.config.job_token});
  } else if (url.rfind("file://", 0) == 0) {
    rv.config = config_from_env(env, false);
    rv.store = std::make_shared<FileStore>(url.substr(7), timeout);
  } else {
    throw ValueError(fmt::format("rendezvous: unknown init method '{}' (expected env:// or file:///path)", url));
  }
  join_world(*rv.store, rv.config.rank, rv.config.world_size);
  return rv;
}

}  // namespace mpt::dist
