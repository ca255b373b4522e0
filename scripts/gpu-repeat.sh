#!/usr/bin/env bash
# Runs the GPU test binaries of a staged build folder many times in a shuffled
# order, to find tests that fail only now and then (fresh random inputs each
# repeat). Prints, per binary, how many repeats failed and the failures' lines.
#   scripts/gpu-repeat.sh [build-stage] [repeats] [binary ...]
set -uo pipefail
build_dir=${1:-build-stage}
repeats=${2:-10}
shift $(( $# > 2 ? 2 : $# ))
out=${OUT:-gpu-logs}
mkdir -p "$out"
export LD_LIBRARY_PATH="$PWD/$build_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
binaries=("$@")
if (( ${#binaries[@]} == 0 )); then
  for t in "$build_dir"/tests/test_cuda_* "$build_dir"/tests/test_parallel_gpu; do
    [[ -x $t ]] && binaries+=("$(basename "$t")")
  done
fi
status=0
for name in "${binaries[@]}"; do
  log="$out/repeat-$name.log"
  "$build_dir/tests/$name" --gtest_brief=1 --gtest_repeat="$repeats" --gtest_shuffle \
    --gtest_random_seed=0 >"$log" 2>&1 || status=1
  failed=$(grep -c '^\[  FAILED  \].*ms)$' "$log")
  echo "== $name: $repeats repeats, $failed failed test runs"
  grep -E '^\[  FAILED  \]|Failure|Which is|seed|random seed' "$log" | head -30
done
exit $status
