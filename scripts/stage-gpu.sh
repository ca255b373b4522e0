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
# Not installed on the GPU machine: Gloo and the libraries it pulls in
# (hiredis, ibverbs, netlink); the C and C++ runtimes are there.
for lib in /usr/lib/libgloo.so* /usr/lib/x86_64-linux-gnu/libgloo.so*; do
  [[ -e $lib ]] && cp -aL "$lib" "$stage/"
done
if [[ -e $stage/libgloo.so.0 ]]; then
  ldd "$stage/libgloo.so.0" | awk '/hiredis|ibverbs|libnl/ {print $3}' | while read -r dep; do
    cp -aL "$dep" "$stage/"
  done
fi
# Nor oneDNN (Debian's libdnnl2), which the CPU backend links where the
# build found it, nor the OpenMP runtime it was built with.
for lib in /usr/lib/x86_64-linux-gnu/libdnnl.so.2; do
  [[ -e $lib ]] && cp -aL "$lib" "$stage/"
done
if [[ -e $stage/libdnnl.so.2 ]]; then
  ldd "$stage/libdnnl.so.2" | awk '/libgomp/ {print $3}' | while read -r dep; do
    cp -aL "$dep" "$stage/"
  done
fi
# The PyTorch reference benchmark, which lives beside the checkout.
[[ -d ../shared/reference ]] && cp -a ../shared/reference "$stage/reference"
# The data sets of Debian's dataset-fashion-mnist and fortunes-min, which
# the GPU machine lacks.
if [[ ${MPT_STAGE_DATA:-0} == 1 ]]; then
  mkdir -p "$stage/data"
  cp /usr/share/datasets/fashion-mnist/*.gz /usr/share/games/fortunes/fortunes "$stage/data/"
fi
# Symbol tables are not needed there, and the copy must stay small.
strip --strip-unneeded "$stage"/tests/* "$stage"/tools/*/* "$stage"/libmptrain.so.* 2>/dev/null || true
du -sh "$stage"
