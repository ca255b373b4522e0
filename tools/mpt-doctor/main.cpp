// mpt-doctor: checks a machine and a job's environment before training, and
// with --comm proves that every device and rank can all-reduce. Exit
// status: 0 no problems (warnings allowed), 1 problems found, 2 a wrong
// command line, 3 the doctor itself failed.
#include <CLI/CLI.hpp>

#include <cstdio>

#include "tensor/error.h"
#include "tools/cli_checks.h"
#include "diag/checks.h"

int main(int argc, char** argv) {
  bool json = false, comm = false;
  int connect_timeout_ms = 2000;
  mpt::diag::CommOptions comm_options;
  std::vector<size_t> sizes = {4096, 1u << 20, 16u << 20};
  CLI::App app{"mpt-doctor: is this machine ready to train? Versions, GPUs, links, distributed variables, ports; "
               "--comm adds all-reduce tests"};
  app.option_defaults()->always_capture_default();
  app.add_flag("--json", json, "Print the report as one JSON document");
  app.add_flag("--comm", comm, "All-reduce smoke tests: Gloo over CPU ranks, NCCL over every local GPU");
  app.add_option("--sizes", sizes, "--comm: bytes per all-reduce")->check(mpt::tools::positive());
  app.add_option("--gloo-ranks", comm_options.gloo_ranks, "--comm: CPU ranks for the Gloo test")
      ->check(CLI::Range(2, 64));
  app.add_option("--iterations", comm_options.iterations, "--comm: timed all-reduces per size")
      ->check(CLI::Range(1, 10000));
  app.add_option("--connect-timeout-ms", connect_timeout_ms,
                 "How long to try reaching MASTER_ADDR:MASTER_PORT (only for ranks other than 0)")
      ->check(CLI::Range(1, 600000));
  if (const auto status = mpt::tools::parse_command_line(app, argc, argv)) return *status;
  comm_options.sizes = sizes;

  try {
    mpt::diag::Report report;
    mpt::diag::check_system(report);
    mpt::diag::check_environment(report, mpt::dist::Millis(connect_timeout_ms));
    if (comm) mpt::diag::check_comm(report, comm_options);
    if (json)
      std::printf("%s\n", report.json().dump(2).c_str());
    else
      std::printf("%s", report.human().c_str());
    return report.count(mpt::diag::Severity::problem) > 0 ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mpt-doctor: %s\n", e.what());
    return 3;  // apart from a usage error's 2
  }
}
