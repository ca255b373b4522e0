#!/usr/bin/env bash
# Runs the test suite of a build folder. GPU tests (label "gpu") run where a
# CUDA device exists and skip visibly elsewhere.
set -euo pipefail
build_dir=${1:-build}
shift || true
if ! "$build_dir/tests/test_cuda_tensor" --gtest_list_tests >/dev/null 2>&1 || \
   ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "GPU tests: skipped: no CUDA device"
fi
# Each test carries its own timeout (tests/CMakeLists.txt); --timeout bounds
# any test that lacks one.
exec ctest --test-dir "$build_dir" --output-on-failure --timeout 600 -j "${MPT_JOBS:-$(nproc)}" "$@"
