#!/usr/bin/env bash
# Installs a built mptrain into a temporary prefix, then configures, builds
# and runs examples/train_mlp against that prefix alone (not the build
# tree), as an application embedding the library would.
# Usage: example_install_test.sh <source dir> <build dir>
set -euo pipefail
src=$1
build=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cmake --install "$build" --prefix "$work/prefix" >/dev/null
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi
cmake -S "$src/examples/train_mlp" -B "$work/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
found=$(sed -n 's/^mptrain_DIR:PATH=//p' "$work/build/CMakeCache.txt")
case $found in
  "$work/prefix"/*) ;;
  *) echo "example_install_test: found mptrain in '$found', not in the install prefix" >&2; exit 1 ;;
esac
cmake --build "$work/build" >/dev/null
"$work/build/train_mlp" "$work/example.safetensors"
test -s "$work/example.safetensors"
echo "example_install_test: built and ran train_mlp against $found"
