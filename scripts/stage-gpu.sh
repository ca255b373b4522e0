#!/usr/bin/env bash
# Copies what the GPU machine needs from a build folder (the library, the
# test and tool binaries, and shared libraries that machine lacks) into a
# small folder of the same layout, to travel there instead of the whole build.
#   scripts/stage-gpu.sh [build] [build-stage]
set -euo pipefail
build=${1:-build}
stage=${2:-build-stage}
rm -rf "$stage"
mkdir -p "$stage/tests" "$stage/tools" "$stage/bench"
cp -a "$build"/libmptrain.so* "$stage/"
# The GPU's own benchmarks (scripts/fp8_vs_torch.py runs bench_fp8_gemm).
for b in "$build"/bench/bench_fp8_gemm "$build"/bench/bench_gemm_candidates; do
  [[ -f $b && -x $b ]] && cp -a "$b" "$stage/bench/"
done
for t in "$build"/tests/test_* "$build"/tests/*_worker "$build"/tests/parallel/*; do
  [[ -f $t && -x $t ]] && cp -a "$t" "$stage/tests/"
done
for d in "$build"/tools/*/; do
  name=$(basename "$d")
  [[ -x $d/$name ]] || continue
  mkdir -p "$stage/tools/$name"
  cp -a "$d/$name" "$stage/tools/$name/"
done
# Libraries the GPU machine lacks (its C and C++ runtimes are there): a
# library's files, then those of its dependencies whose names match `deps`.
#   copy_library <soname> <deps pattern> <files...>
copy_library() {
  local soname=$1 deps=$2 lib dep
  shift 2
  for lib in "$@"; do
    if [[ -e $lib ]]; then cp -aL "$lib" "$stage/"; fi
  done
  [[ -e $stage/$soname ]] || return 0
  ldd "$stage/$soname" | awk -v deps="$deps" '$0 ~ deps {print $3}' | while read -r dep; do
    cp -aL "$dep" "$stage/"
  done
}
# Gloo and what it pulls in (hiredis, ibverbs, netlink).
copy_library libgloo.so.0 'hiredis|ibverbs|libnl' /usr/lib/libgloo.so* /usr/lib/x86_64-linux-gnu/libgloo.so*
# oneDNN (Debian's libdnnl2), which the CPU backend links where the build
# found it, and the OpenMP runtime it was built with.
copy_library libdnnl.so.2 'libgomp' /usr/lib/x86_64-linux-gnu/libdnnl.so.2
# The PyTorch reference benchmark, which lives beside the checkout.
[[ -d ../shared/reference ]] && cp -a ../shared/reference "$stage/reference"
# The data sets of Debian's dataset-fashion-mnist and fortunes-min, which
# the GPU machine lacks.
if [[ ${MPT_STAGE_DATA:-0} == 1 ]]; then
  mkdir -p "$stage/data"
  cp /usr/share/datasets/fashion-mnist/*.gz /usr/share/games/fortunes/fortunes "$stage/data/"
fi
# Symbol tables are not needed there, and the copy must stay small.
strip --strip-unneeded "$stage"/tests/* "$stage"/tools/*/* "$stage"/bench/* "$stage"/libmptrain.so.* 2>/dev/null || true
du -sh "$stage"
