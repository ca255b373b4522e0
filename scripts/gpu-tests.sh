#!/usr/bin/env bash
# Runs every test binary of a build folder copied to a GPU machine (CTest's
# files hold this machine's absolute paths, so the binaries are run directly).
# Writes each binary's full log to $OUT (or ./gpu-logs) and prints a summary.
set -uo pipefail
build_dir=${1:-build}
out=${OUT:-gpu-logs}
mkdir -p "$out"
export LD_LIBRARY_PATH="$PWD/$build_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi -L || true
status=0
for t in "$build_dir"/tests/test_*; do
  [[ -x $t ]] || continue
  name=$(basename "$t")
  "$t" --gtest_brief=1 >"$out/$name.log" 2>&1 || status=1
  echo "== $name: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/$name.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \]|Failure|Expected|actual|Which is|Google Test trace|seed' "$out/$name.log" | head -40
done
exit $status
