// mpt-run: starts one process per local device with the torchrun variables
// set (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT), prefixes their output with the rank, and stops every rank
// as soon as one fails, naming it and its exit status.
//
//   mpt-run --nproc_per_node 2 ./train --epochs 3
//   mpt-run --nproc_per_node 8 --nnodes 2 --node_rank 1 --master_addr node0 --job_token $TOKEN ./train
//
// Every rank gets a job token (MPT_JOB_TOKEN) that rank 0's store checks, so
// a process of another job cannot join this one by mistake: the one given,
// else $MPT_JOB_TOKEN, else (one node only) a fresh random one.
//
// Unless MPT_CPU_THREADS is set, each rank's CPU backend gets its share of
// the CPUs this launcher may use (at least one): ranks that each took them
// all would crowd each other out.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "parallel/tcp_store.h"
#include "parallel/launcher.h"
#include "tensor/backend_settings.h"
#include "tools/cli_checks.h"

int main(int argc, char** argv) {
  CLI::App app{"Start a distributed job: one process per local device, torchrun's variables set"};
  app.option_defaults()->always_capture_default();
  int nproc = 0, nnodes = 1, node_rank = 0, master_port = 29500;
  std::string master_addr = "127.0.0.1";
  double kill_grace = 5.0;
  std::string job_token;
  std::vector<std::string> command;
  // The count is explicit: CUDA_VISIBLE_DEVICES alone never decides it.
  app.add_option("--nproc_per_node,--nproc-per-node", nproc, "processes on this node (usually one per GPU)")
      ->required()
      ->default_str("")  // required: the 0 it starts from is no default
      ->check(CLI::Range(1, 1024));
  app.add_option("--nnodes", nnodes, "number of nodes")->check(CLI::Range(1, 100000));
  app.add_option("--node_rank,--node-rank", node_rank, "this node's index, 0..nnodes-1")
      ->check(mpt::tools::non_negative());
  app.add_option("--master_addr,--master-addr", master_addr, "host of rank 0 (its store)");
  app.add_option("--master_port,--master-port", master_port, "port of rank 0's store")->check(CLI::Range(1, 65535));
  app.add_option("--job_token,--job-token", job_token,
                 "shared secret of this job's processes (default: $MPT_JOB_TOKEN; on one node, a random one)");
  app.add_option("--kill_timeout,--kill-timeout", kill_grace,
                 "seconds a rank gets to exit after SIGTERM before SIGKILL")
      ->check(mpt::tools::non_negative());
  app.prefix_command();  // everything from the program on belongs to it
  app.footer("After the options: the program to run and its arguments (a '--' before them is optional).");
  if (const auto status = mpt::tools::parse_command_line(app, argc, argv)) return *status;
  command = app.remaining();
  // "mpt-run --nproc_per_node 2 -- ./train": the separator ends mpt-run's
  // options; it is not the program.
  if (!command.empty() && command.front() == "--") {
    command.erase(command.begin());
  } else if (!command.empty() && command.front().starts_with("-")) {
    // Not a program: an option mpt-run does not know (torchrun's --standalone
    // or --rdzv-*), which would otherwise be run as the program.
    fmt::print(stderr,
               "mpt-run: unknown option '{}' (see --help; to run a program whose name starts with '-', put '--' "
               "before it)\n",
               command.front());
    return mpt::tools::kUsageError;
  }
  if (command.empty()) {
    fmt::print(stderr, "mpt-run: no program given\n{}", app.help());
    return mpt::tools::kUsageError;
  }
  if (nnodes > 1 && app.count("--master_addr") == 0) {
    fmt::print(stderr,
               "mpt-run: --nnodes {} needs --master_addr, the host of node 0 as every node reaches it (the default "
               "127.0.0.1 reaches only this host)\n",
               nnodes);
    return mpt::tools::kUsageError;
  }
  if (node_rank >= nnodes) {
    fmt::print(stderr, "mpt-run: --node_rank {} must be below --nnodes {}\n", node_rank, nnodes);
    return mpt::tools::kUsageError;
  }

  if (job_token.empty())
    if (const char* env = std::getenv("MPT_JOB_TOKEN")) job_token = env;
  try {
    // Several launchers must agree on the token, so only a lone one invents it.
    if (job_token.empty() && nnodes == 1) job_token = mpt::dist::random_job_token();
  } catch (const std::exception& e) {
    fmt::print(stderr, "mpt-run: {}\n", e.what());
    return 1;
  }

  std::string cpu_threads;
  if (const char* set = std::getenv("MPT_CPU_THREADS"); set == nullptr || *set == '\0') {
    cpu_threads = std::to_string(std::max(1, mpt::usable_cpus() / nproc));
  }
  std::vector<mpt::dist::RankSpec> ranks;
  for (int local = 0; local < nproc; ++local) {
    mpt::dist::RankSpec spec;
    spec.rank = node_rank * nproc + local;
    spec.env = {{"RANK", std::to_string(spec.rank)},
                {"WORLD_SIZE", std::to_string(nnodes * nproc)},
                {"LOCAL_RANK", std::to_string(local)},
                {"LOCAL_WORLD_SIZE", std::to_string(nproc)},
                {"GROUP_RANK", std::to_string(node_rank)},
                {"MASTER_ADDR", master_addr},
                {"MASTER_PORT", std::to_string(master_port)},
                {"MPT_JOB_TOKEN", job_token}};
    if (!cpu_threads.empty()) spec.env["MPT_CPU_THREADS"] = cpu_threads;
    ranks.push_back(std::move(spec));
  }
  try {
    const auto outcome = mpt::dist::supervise(command, ranks, kill_grace);
    if (!outcome.failure.empty()) {
      fmt::print(stderr, "mpt-run: {}; stopped the other ranks\n", outcome.failure);
      return outcome.exit_code;
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}\n", e.what());
    return 1;
  }
  return 0;
}
