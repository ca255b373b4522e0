#pragma once
// Rendezvous: how the ranks of a job learn who they are and find each
// other. `env://` reads what torchrun (and mpt-run) export, falling back to
// what Open MPI's mpirun and Slurm's srun set:
//
//   rank              RANK              OMPI_COMM_WORLD_RANK        SLURM_PROCID
//   world size        WORLD_SIZE        OMPI_COMM_WORLD_SIZE        SLURM_NTASKS
//   local rank        LOCAL_RANK        OMPI_COMM_WORLD_LOCAL_RANK  SLURM_LOCALID
//   local world size  LOCAL_WORLD_SIZE  OMPI_COMM_WORLD_LOCAL_SIZE  SLURM_NTASKS_PER_NODE
//   master            MASTER_ADDR, MASTER_PORT (always needed for env://)
//   job token         MPT_JOB_TOKEN (optional; every process of a job the same)
//   store address     MPT_STORE_BIND_ADDR (optional: where rank 0's store
//                     listens; default MASTER_ADDR when numeric, else all
//                     interfaces)
//
// Rank 0 hosts a TcpStore at MASTER_ADDR:MASTER_PORT. `file:///shared/dir`
// uses a FileStore there instead (rank and world size still from the
// environment). Without a local rank, the process is taken to be alone on
// its node's devices: LOCAL_RANK = RANK, LOCAL_WORLD_SIZE = WORLD_SIZE.
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "parallel/store.h"

namespace mpt::dist {

struct RendezvousConfig {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr;
  int master_port = 0;
  std::string launcher;  // "torchrun", "Open MPI" or "Slurm": which variables named the rank
  std::string store_bind_address;  // where rank 0's TcpStore listens; empty: every interface
  std::string job_token;           // MPT_JOB_TOKEN: the store refuses processes of other jobs
};

// Looks a variable up; the process environment by default, a map in tests.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;
std::optional<std::string> process_env(const std::string& name);

// Reads and checks the variables; ValueError names the first one missing or
// malformed. need_master: MASTER_ADDR/MASTER_PORT are required (env://).
RendezvousConfig config_from_env(const EnvLookup& env = process_env, bool need_master = true);

struct Rendezvous {
  RendezvousConfig config;
  std::shared_ptr<Store> store;
};

// Connects to (or, on rank 0, hosts) the store named by `url` and waits
// until every rank has arrived. Every wait is bounded by `timeout`.
Rendezvous rendezvous(const std::string& url = "env://", Millis timeout = kDefaultTimeout,
                      const EnvLookup& env = process_env);

// The arrival check on an existing store: marks this rank as arrived, then
// waits for all `world_size` ranks. DistributedError when two processes
// claim one rank or the ranks disagree about the world size; TimeoutError
// listing the ranks that arrived and those still missing.
void join_world(Store& store, int rank, int world_size);

// The ranks whose process has left the job since join_world (its store
// connection closed: it exited or died), first to leave first. Empty where
// the store cannot tell (a FileStore). Throws when the store is unreachable
// (each question waits at most `timeout`; default: the store's).
std::vector<int> departed_ranks(Store& store, int world_size, std::optional<Millis> timeout = std::nullopt);

// For the error of a collective that failed on a broken connection: which
// rank left the job first ("rank 1 left the job first ..."), waiting up to
// `grace` for the store to notice a connection that just closed; when the
// store is unreachable too, that rank 0, its host, is gone. Ranks that gave
// up at their own timeout (note_gave_up) are survivors, not the cause, and
// are said to be so. Each question to the store waits at most `grace`.
// Never throws.
std::string describe_departures(Store& store, int world_size, Millis grace = std::chrono::seconds(2));

// Records in the store that `rank` ends because its own collective timed
// out (a stalled peer: all survivors time out at about the same moment, and
// the first of them to exit must not be named as the cause by the others).
// Waits at most `grace`; never throws.
void note_gave_up(Store& store, int rank, Millis grace = std::chrono::seconds(2));

// Records in the store that `rank` needs it no more to explain a failure of
// the group named by `scope` (a key prefix): it has asked who left, or
// closed its process group. Waits at most `grace`; never throws.
void note_finished(Store& store, const std::string& scope, int rank, Millis grace = std::chrono::milliseconds(500));

// After a failure on the rank whose process hosts the store: waits until
// every other rank has left or finished (note_finished in `scope`), at
// most `grace`, so that the others can still ask the store who left first.
// Returns at once elsewhere.
void linger_for_departures(Store& store, const std::string& scope, int rank, int world_size,
                           Millis grace = std::chrono::seconds(2));

}  // namespace mpt::dist
