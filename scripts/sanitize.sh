#!/usr/bin/env bash
# The memory and undefined-behaviour check: builds the library, the tests,
# the tools and the fuzz targets with clang under AddressSanitizer and
# UndefinedBehaviorSanitizer in a folder of their own (CPU only), runs the
# test suite there, then each fuzz target for a short while over its corpus.
# Any sanitizer report fails the run.
#   scripts/sanitize.sh [build folder]     (default build-asan)
# Environment: MPT_JOBS (default: all cores), MPT_FUZZ_SECONDS (per fuzz
# target, default 20).
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${1:-build-asan}
jobs=${MPT_JOBS:-$(nproc)}
fuzz_seconds=${MPT_FUZZ_SECONDS:-20}

# clang-14 compiles; libclang-rt-14-dev holds the sanitizer and libFuzzer runtimes.
scripts/setup.sh clang-14 libclang-rt-14-dev
# Optimised (the training tests stay quick), with line tables only: enough
# for file:line in the reports, and much less to compile than full -g.
if [[ ! -f $build_dir/build.ninja ]]; then
  # shellcheck disable=SC2086
  CC=clang-14 CXX=clang++-14 cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -gline-tables-only -DNDEBUG" \
    -DMPT_WITH_CUDA=OFF -DMPT_SANITIZE=ON -DMPT_BUILD_FUZZERS=ON -DMPT_BUILD_BENCHMARKS=OFF ${MPT_CMAKE_ARGS:-}
fi
cmake --build "$build_dir" -j "$jobs"

export ASAN_OPTIONS=detect_leaks=1:check_initialization_order=1:strict_init_order=1:detect_stack_use_after_return=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# examples_installed builds the examples with the system compiler
# against the installed library; it checks packaging, not memory, and runs in
# the plain build's suite.
ctest --test-dir "$build_dir" --output-on-failure --timeout 2400 -j "$jobs" -E '^examples_installed$'

# New inputs the fuzzers find go to a scratch folder (the first corpus
# folder named), so the committed corpora stay as they are; an input that
# fails is kept in $build_dir/fuzz-artifacts/.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$build_dir/fuzz-artifacts"
for fuzzer in fuzz_safetensors fuzz_idx fuzz_store_message; do
  corpus=tests/fuzz/corpus/${fuzzer#fuzz_}
  mkdir -p "$scratch/$fuzzer"
  log=$scratch/$fuzzer.log
  if ! "$build_dir/tests/fuzz/$fuzzer" -max_total_time="$fuzz_seconds" -timeout=10 -rss_limit_mb=2048 \
      -print_final_stats=1 -artifact_prefix="$build_dir/fuzz-artifacts/$fuzzer-" "$scratch/$fuzzer" "$corpus" \
      >"$log" 2>&1; then
    tail -n 80 "$log" >&2
    echo "$fuzzer: found a fault; the input is in $build_dir/fuzz-artifacts/" >&2
    exit 1
  fi
  echo "$fuzzer: $fuzz_seconds s over $corpus, $(grep -o 'number_of_executed_units: [0-9]*' "$log" | grep -o '[0-9]*$') inputs, no fault"
done
echo "sanitizers: clean"
