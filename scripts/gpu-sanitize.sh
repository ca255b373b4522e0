#!/usr/bin/env bash
# Runs the GPU test binaries of a staged build folder under NVIDIA's
# compute-sanitizer, the tools side by side, each over the binaries in turn:
#   memcheck   out-of-bounds and misaligned accesses in every kernel (cuBLAS's
#              and cuDNN's too: they read our buffers);
#   synccheck  barrier misuse in our kernels;
#   racecheck  shared-memory hazards; every kernel is instrumented (keeping
#              it to ours with --kernel-name makes the H200's sanitizer fail
#              on a hardware exception), and hazards are counted in our
#              kernels apart from the libraries' (cuBLASLt's warp-specialized
#              kernels synchronize through barriers racecheck does not follow);
#   initcheck  reads of global memory never written; not run by default: it
#              does not see the TMA stores of cuBLASLt's Hopper kernels, so
#              every read of a 16-bit matmul's output looks uninitialized.
# MPT_SANITIZER_TOOLS picks the tools, GTEST_FILTER (read by the tests) the
# tests. One log per tool goes to $OUT (or ./gpu-logs); the summary gives,
# per tool and binary, the errors reported and whether the tests passed.
# Failed API calls are not counted: some tests provoke them on purpose (out
# of memory, a synchronization inside a capture), NCCL probes with them, and
# the library checks every status itself.
#   scripts/gpu-sanitize.sh [build-stage] [seconds per binary] [binary ...]
set -uo pipefail
build_dir=${1:-build-stage}
limit=${2:-240}
shift $(( $# > 2 ? 2 : $# ))
out=${OUT:-gpu-logs}
mkdir -p "$out"
export LD_LIBRARY_PATH="$PWD/$build_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
[[ -x $sanitizer ]] || { echo "compute-sanitizer not found"; exit 2; }
"$sanitizer" --version | tail -1
binaries=("$@")
if (( ${#binaries[@]} == 0 )); then
  for t in "$build_dir"/tests/test_cuda_* "$build_dir"/tests/test_parallel_gpu; do
    [[ -x $t ]] && binaries+=("$(basename "$t")")
  done
fi

run_tool() {
  local tool=$1 log="$out/sanitize-$1.log" part
  shift
  part=$(mktemp)
  : >"$log"
  for name in "${binaries[@]}"; do
    timeout "$limit" "$sanitizer" --tool "$tool" --report-api-errors no --print-limit 100 "$@" \
      "$build_dir/tests/$name" --gtest_brief=1 >"$part" 2>&1
    local rc=$? errors ours tests
    errors=$(grep -oE '(ERROR|RACECHECK) SUMMARY: [0-9]+' "$part" | grep -oE '[0-9]+$' | head -1)
    # Kernels named in the reports (a hazard names two threads' kernels).
    ours=$(grep -E '^=========     (at|(Read|Write) Thread .* at) ' "$part" | grep -c 'mpt::')
    tests=$(grep -E '^\[  (PASSED|FAILED) ' "$part" | tr '\n' ' ')
    (( rc == 124 )) && tests="timed out after $limit s"
    echo "$tool $name: ${errors:-?} errors, $ours report lines in our kernels; $tests" >>"$out/sanitize-summary.txt"
    { echo "##### $name (exit $rc)"; cat "$part"; } >>"$log"
  done
  rm -f "$part"
}

: >"$out/sanitize-summary.txt"
for tool in ${MPT_SANITIZER_TOOLS:-memcheck synccheck racecheck}; do
  case $tool in
    synccheck) run_tool synccheck --kernel-name kns=mpt & ;;
    racecheck) run_tool racecheck --racecheck-report hazard & ;;
    *) run_tool "$tool" & ;;
  esac
done
wait
sort "$out/sanitize-summary.txt"
# Failing: any error of memcheck or synccheck, a report in our kernels, a failed test.
! grep -qE '^(memcheck|synccheck) .*: [1-9][0-9]* errors|, [1-9][0-9]* report lines|FAILED' "$out/sanitize-summary.txt"
