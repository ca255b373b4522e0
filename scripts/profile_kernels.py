#!/usr/bin/env python3
"""Kernel time of one mpt-bench step, by kernel, from Nsight Compute (the GPU
machine has ncu but no nsys). Runs one eager step under ncu (each kernel
timed on its own, so the sum is GPU busy time without overlap) and prints
the kernels that take the most time, grouped by name. `--mode ddp` runs the
step under DistributedDataParallel with one rank (ncu replays each kernel,
which a collective waiting for a peer would not survive): what DDP adds to
the GPU's work besides communication.

  scripts/profile_kernels.py --build build-stage --workload gpt_mini [--mode ddp] [--top 25] [-- mpt-bench options]"""
import argparse
import collections
import csv
import io
import os
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--workload", default="gpt_mini")
    ap.add_argument("--precision", default="fp16")
    ap.add_argument("--mode", default="single", choices=["single", "ddp"])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--name-width", type=int, default=90, help="characters of each kernel's name kept")
    ap.add_argument("bench_args", nargs="*", help="more mpt-bench options (after --)")
    a = ap.parse_args()
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.path.abspath(a.build) + ":" + env.get("LD_LIBRARY_PATH", "")
    if a.mode == "ddp":
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=env.get("MASTER_PORT", "29531"))
    bench = os.path.join(a.build, "tools", "mpt-bench", "mpt-bench")
    cmd = ["ncu", "--csv", "--metrics", "gpu__time_duration.sum", bench, "--workload", a.workload, "--mode", a.mode,
           "--precision", a.precision, "--no-graph", "--warmup", "1", "--steps", "1"] + a.bench_args
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    rows = [l for l in p.stdout.splitlines() if l.startswith('"')]
    if p.returncode != 0 or not rows:
        sys.exit(f"profile_kernels: ncu failed ({p.returncode}): {p.stderr[-2000:]}")
    total = collections.Counter()
    count = collections.Counter()
    for r in csv.DictReader(io.StringIO("\n".join(rows))):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = r["Kernel Name"].split("(")[0][:a.name_width]
        value = float(r["Metric Value"].replace(",", ""))
        scale = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3}.get(r.get("Metric Unit", "nsecond"), 1e-6)
        total[name] += value * scale
        count[name] += 1
    all_ms = sum(total.values())
    print(f"{a.workload} {a.mode}: {sum(count.values())} kernels, {all_ms:.3f} ms of kernel time in two steps "
          "(the first with its setup)")
    print("| kernel | launches | ms | share |")
    print("|---|---|---|---|")
    for name, ms in total.most_common(a.top):
        print(f"| {name} | {count[name]} | {ms:.3f} | {ms / all_ms:.1%} |")


if __name__ == "__main__":
    main()
