#!/usr/bin/env bash
# Installs a built mptrain into a temporary prefix, then configures and
# builds examples/ against that prefix alone (not the build tree), as an
# application embedding the library would, and runs the examples:
#   residual_mlp: the step API; a run stopped at step 60 and resumed from
#                 its checkpoint, then two ranks under mpt-run (Gloo on the
#                 CPU, NCCL where there are GPUs);
#   custom_loop:  the pieces by hand, alone and under mpt-run.
# Usage: example_install_test.sh <source dir> <build dir>
set -euo pipefail
src=$1
build=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cmake --install "$build" --prefix "$work/prefix" >/dev/null
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi
cmake -S "$src/examples" -B "$work/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
found=$(sed -n 's/^mptrain_DIR:PATH=//p' "$work/build/CMakeCache.txt")
case $found in
  "$work/prefix"/*) ;;
  *) echo "example_install_test: found mptrain in '$found', not in the install prefix" >&2; exit 1 ;;
esac
cmake --build "$work/build" >/dev/null
run=$build/tools/mpt-run/mpt-run

# Runs a command, prints its output, and fails unless it succeeded and
# its output holds every line given before the command.
expect() {
  local expected=()
  while [[ $1 != -- ]]; do expected+=("$1"); shift; done
  shift
  local out
  out=$("$@" 2>&1) || { echo "$out"; echo "example_install_test: '$*' failed" >&2; return 1; }
  echo "$out"
  for e in "${expected[@]}"; do
    grep -qF -- "$e" <<<"$out" || { echo "example_install_test: '$*' did not say '$e'" >&2; return 1; }
  done
}

cd "$work"
expect "stopped after step 60 of 120" -- build/residual_mlp run.safetensors --steps 120 --stop-after 60
expect "resumed from run.safetensors at step 60" "done after step 120 of 120" -- \
  build/residual_mlp run.safetensors --steps 120
expect "saved custom_loop.safetensors" -- build/custom_loop custom_loop.safetensors
if [[ -x $run ]]; then
  expect "done after step 60 of 60" "2 ranks)" -- "$run" --nproc_per_node 2 build/residual_mlp ddp.safetensors --steps 60
  expect "saved ddp_loop.safetensors" -- "$run" --nproc_per_node 2 build/custom_loop ddp_loop.safetensors
fi
echo "example_install_test: built and ran the examples against $found"
