#!/usr/bin/env bash
# Two builds of mpt-bench beside PyTorch eager in one call on the GPU
# machine: the staged build and an earlier one (its mpt-bench and
# libmptrain.so.0, or libmptrain.so.0.1.0.xz, in one folder), each
# single-GPU workload in turns (PyTorch, staged, earlier), twice, the better
# of the two rounds kept. Prints a Markdown table of the ratios; raw lines
# go to $OUT/bench.jsonl.
#   scripts/bench_builds.sh build-stage build-stage/before
set -uo pipefail
stage=${1:-build-stage}
earlier=${2:?name the folder of the earlier mpt-bench and its library}
# shellcheck source=scripts/gpu-stage-env.sh
source "$(dirname "$0")/gpu-stage-env.sh"
lib=$(mktemp -d)
cp "$earlier"/mpt-bench "$lib/"
if [[ -f $earlier/libmptrain.so.0.1.0.xz ]]; then xz -dc "$earlier"/libmptrain.so.0.1.0.xz >"$lib/libmptrain.so.0"
else cp -L "$earlier"/libmptrain.so.0 "$lib/"; fi
cp -L "$stage"/libgloo.so.0 "$stage"/libhiredis* "$stage"/libibverbs* "$stage"/libnl* "$lib/" 2>/dev/null
log="$out/bench.jsonl"
tagged() { sed "s/^/{\"side\": \"$1\", \"j\": /; s/$/}/" >>"$log"; }
for w in mlp_small cnn gpt_mini mlp_large; do
  for round in 1 2; do
    python3 "$stage/reference/torch_bench.py" --workload "$w" --mode single | tagged torch
    "$stage/tools/mpt-bench/mpt-bench" --workload "$w" | tagged staged
    LD_LIBRARY_PATH="$lib" "$lib/mpt-bench" --workload "$w" | tagged earlier
  done
done
python3 - "$log" <<'PY'
import collections, json, sys
best = collections.defaultdict(lambda: float("inf"))
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except ValueError:
        continue
    key = (r["j"].get("workload"), r["side"])
    best[key] = min(best[key], r["j"].get("step_ms_median", float("inf")))
print("| workload | PyTorch eager ms | earlier ms | staged ms | earlier / PyTorch | staged / PyTorch | staged / earlier |")
print("|---|---|---|---|---|---|---|")
for w in ["mlp_small", "cnn", "gpt_mini", "mlp_large"]:
    t, e, s = best[(w, "torch")], best[(w, "earlier")], best[(w, "staged")]
    print(f"| {w} | {t:.4f} | {e:.4f} | {s:.4f} | {e / t:.3f} | {s / t:.3f} | {s / e:.3f} |")
PY
