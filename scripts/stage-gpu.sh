#!/usr/bin/env bash
# Copies what the GPU machine needs from a build folder (the library, the
# test and tool binaries, and shared libraries that machine lacks) into a
# small folder of the same layout, to travel there instead of the whole build.
#   scripts/stage-gpu.sh [build] [build-stage]
set -euo pipefail
build=${1:-build}
stage=${2:-build-stage}
rm -rf "$stage"
mkdir -p "$stage/tests" "$stage/tools"
cp -a "$build"/libmptrain.so* "$stage/"
for t in "$build"/tests/test_* "$build"/tests/*_worker "$build"/tests/parallel/*; do
  [[ -f $t && -x $t ]] && cp -a "$t" "$stage/tests/"
done
for d in "$build"/tools/*/; do
  name=$(basename "$d")
  [[ -x $d/$name ]] || continue
  mkdir -p "$stage/tools/$name"
  cp -a "$d/$name" "$stage/tools/$name/"
done
# Not installed on the GPU machine: Gloo (and what it pulls in).
for lib in /usr/lib/libgloo.so* /usr/lib/x86_64-linux-gnu/libgloo.so*; do
  [[ -e $lib ]] && cp -aL "$lib" "$stage/"
done
# The PyTorch reference benchmark, which lives beside the checkout.
[[ -d ../shared/reference ]] && cp -a ../shared/reference "$stage/reference"
du -sh "$stage"
