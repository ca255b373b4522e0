#!/usr/bin/env python3
"""Runs the PyTorch reference (shared/reference/torch_bench.py) and mpt-bench
side by side on this GPU machine, for every workload and mode asked for, and
prints a Markdown table of step times and ours/PyTorch ratios.

  scripts/bench_vs_torch.py --build build [--workloads ...] [--modes ...]

Workloads: the reference's four (the default) and gpt2_124m (GPT-2 small's
sizes, batch 16), and cnn_bn, its cnn with a BatchNorm2d after each
convolution (single and dp modes only).

Single mode runs PyTorch eager and under torch.compile (each mode of
--compile, default reduce-overhead and max-autotune-no-cudagraphs; the best
of them is "compiled") and prints ours / eager and ours / compiled: the bar
is the better of the two. GPT workloads add tokens/s and mpt-bench's MFU
(model FLOPs over the GEMM rate it measured in the same run).

--allreduce [f32 f16] adds mpt-bench's all-reduce sweep (the time of one
all-reduce by size and way: NCCL, NCCL's symmetric kernels, our peer kernel).

Each pair runs back to back in the same call, so the ratio compares like
with like; absolute times from other days mean little. Raw JSON lines go to
--log (default: $OUT/bench.jsonl when $OUT is set)."""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def find_reference(build):
    for p in (os.path.join(ROOT, "..", "shared", "reference"), os.path.join(ROOT, "shared", "reference"),
              os.path.join(build, "reference")):
        if os.path.exists(os.path.join(p, "torch_bench.py")):
            return os.path.abspath(p)
    sys.exit("bench_vs_torch: shared/reference/torch_bench.py not found")


def run_json(cmd, env=None, timeout=900):
    """Runs cmd; returns its JSON lines (or an error record)."""
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    # mpt-run prefixes each rank's lines ("[rank 0] {...}").
    lines = [json.loads(l[l.index("{"):]) for l in p.stdout.splitlines() if "{" in l and l.rstrip().endswith("}")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr or p.stdout).strip().splitlines()[-5:]
        return [{"error": f"exit {p.returncode}: " + " | ".join(tail), "cmd": " ".join(cmd)}]
    for l in lines:
        l["wall_s"] = round(time.time() - t0, 1)
    return lines


# torch_bench.py as it is, with the peak allocated memory of GPU 0 added
# (torch_bench.py itself does not report it; ddp's workers are other
# processes, so there it stays unknown). One workload beyond the
# reference's, cnn_bn (its cnn with a BatchNorm2d after each convolution,
# as mpt-bench's), is built here and timed by the reference's own loop, in
# this process only: single and dp.
TORCH_WITH_MEMORY = """
import json, sys, torch
import torch.nn as nn
sys.path.insert(0, sys.argv[1])
import torch_bench
args = sys.argv[2:]
at = args.index("--workload") + 1 if "--workload" in args else None
if at and args[at] == "cnn_bn":
    if "ddp" in args:
        sys.exit("cnn_bn runs in single and dp modes only (ddp's workers would build the reference's cnn)")
    def make(workload, device, batch=None):
        g = torch.Generator(device="cpu").manual_seed(0)
        b = batch or 512
        m = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(64 * 7 * 7, 256), nn.ReLU(), nn.Linear(256, 10))
        x, y = torch.randn(b, 1, 28, 28, generator=g), torch.randint(0, 10, (b,), generator=g)
        return m.to(device), x.to(device), y.to(device)
    report = torch_bench.report
    torch_bench.make = make
    torch_bench.report = lambda **kw: report(**dict(kw, workload="cnn_bn"))
    args[at] = "cnn"  # past the reference's choices; make() above builds cnn_bn
sys.argv = ["torch_bench.py"] + args
torch_bench.main()
if torch.cuda.is_initialized():
    print(json.dumps({"peak_mem_mb": round(torch.cuda.max_memory_allocated(0) / 2**20, 1)}))
"""


def torch_run(ref, args, env):
    lines = run_json([sys.executable, "-c", TORCH_WITH_MEMORY, ref] + args, env)
    result = dict(lines[0])
    for extra in lines[1:]:
        result.update(extra)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--workloads", nargs="*", default=["mlp_small", "cnn", "gpt_mini", "mlp_large"],
                    help="none (--workloads alone): only the ceilings and the all-reduce sweep")
    ap.add_argument("--modes", nargs="+", default=["single", "dp", "ddp"])
    ap.add_argument("--precision", nargs="+", default=["fp16"], help="each precision is a run of its own")
    ap.add_argument("--compile", nargs="*", default=["reduce-overhead", "max-autotune-no-cudagraphs"],
                    help="single mode: torch.compile modes PyTorch also runs in (none: eager only)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--log", default=os.path.join(os.environ["OUT"], "bench.jsonl") if "OUT" in os.environ else None)
    ap.add_argument("--ceilings", action="store_true", help="also run ceilings.py (GEMM rate, copy bandwidth)")
    ap.add_argument("--variants", nargs="*", default=[],
                    help="also run mptrain with each of these sets of mpt-bench options, written without their "
                         "dashes and joined by commas (grad-transit=f16 registered-buffers "
                         "grad-transit=f16,registered-buffers cudnn-attention=false); dp and ddp ones are "
                         "compared with mptrain's own single-GPU run, single ones with its default options")
    ap.add_argument("--allreduce", nargs="*", metavar="TRANSIT",
                    help="also run mpt-bench --mode allreduce (one all-reduce over every GPU, by size and way) in "
                         "each of these transit dtypes (default f32; f32 f16 for both) and print its table")
    a = ap.parse_args()

    ref = find_reference(a.build)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.path.abspath(a.build) + ":" + env.get("LD_LIBRARY_PATH", "")
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    mpt_bench = os.path.join(a.build, "tools", "mpt-bench", "mpt-bench")
    records = []
    log = open(a.log, "w") if a.log else None

    def keep(*new):
        """Records a result, and logs it at once: a call cut short keeps what ran."""
        for r in new:
            records.append(r)
            if log:
                log.write(json.dumps(r) + "\n")
                log.flush()

    if a.ceilings:
        keep(*run_json([sys.executable, os.path.join(ref, "ceilings.py")], env))
    rows = []
    variants = []  # (workload, mode, variant, record)
    for precision in a.precision:
        common = ["--precision", precision, "--warmup", str(a.warmup), "--steps", str(a.steps)]
        for w in a.workloads:
            for m in a.modes:
                torch = torch_run(ref, ["--workload", w, "--mode", m] + common, env)
                torch.setdefault("impl", "pytorch")
                compiled = []
                for mode in a.compile if m == "single" else []:
                    c = torch_run(ref, ["--workload", w, "--mode", m, "--compile", mode] + common, env)
                    c.setdefault("impl", "pytorch")
                    c.setdefault("compile", mode)
                    compiled.append(c)
                ours = run_json([mpt_bench, "--workload", w, "--mode", m] + common, env)[-1]
                keep(torch, *compiled, ours)
                best = min((c for c in compiled if "step_ms_median" in c), key=lambda c: c["step_ms_median"],
                           default=compiled[0] if compiled else None)
                rows.append((w, m, torch, ours, best, precision))
                for variant in a.variants:
                    if w == "cnn_bn" and m == "ddp":
                        continue
                    r = run_json([mpt_bench, "--workload", w, "--mode", m] + variant_options(variant) + common,
                                 env)[-1]
                    r["variant"] = variant
                    keep(r)
                    variants.append((w, m, variant, r, precision))

    sweeps = []
    for transit in ([] if a.allreduce is None else a.allreduce or ["f32"]):
        lines = run_json([mpt_bench, "--mode", "allreduce", "--grad-transit", transit], env)
        keep(*lines)
        sweeps += lines

    if log:
        log.close()
    for r in records:
        if "ceiling" in r:
            print(json.dumps(r))
    print("\n| workload | precision | mode | PyTorch eager ms | PyTorch compiled ms (mode) | mptrain ms | "
          "ours / eager | ours / compiled | tokens/s: eager, compiled, ours | MFU ours | peak MB: PyTorch, ours |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for w, m, t, o, c, precision in rows:
        tm, om, cm = t.get("step_ms_median"), o.get("step_ms_median"), (c or {}).get("step_ms_median")
        ratio = lambda base: f"{om / base:.3f}" if base and om else "n/a"
        compiled = f"{cm} ({c.get('compile')})" if cm else ("-" if c is None else "n/a")
        tokens = ", ".join(str(r.get("tokens_per_s", "-")) for r in (t, c or {}, o)) if w.startswith("gpt") else "-"
        mfu = f"{100 * o['mfu']:.1f}%" if "mfu" in o else "-"
        peaks = f"{t.get('peak_mem_mb', '-')}, {o.get('peak_mem_mb', '-')}"
        err = "; ".join(x["error"] for x in (t, o, c or {}) if "error" in x)
        print(f"| {w} | {precision} | {m} | {tm} | {compiled} | {om} | {ratio(tm)} | {ratio(cm)} | {tokens} | {mfu} "
              f"| {peaks} |" + (f" {err}" if err else ""))
    print_variant_scaling(rows, variants)
    rows = [(w, m, t, o) for w, m, t, o, c, p in rows if p == a.precision[0]]
    print_scaling(rows)
    print_gemm_rate(rows, records)
    print_allreduce(sweeps)


# mlp_large's GEMMs per step: weights [out, in] and the batch.
MLP_LARGE_LAYERS = [(8192, 8192), (8192, 8192), (8192, 8192), (10, 8192)]
MLP_LARGE_BATCH = 8192


def print_gemm_rate(rows, records):
    """mlp_large's step as a rate of the GPU's measured fp16 GEMM rate, two
    ways: model FLOPs (6 x weights x batch, the convention of the reference's
    own "about 620 TFLOP/s") and the FLOPs of the GEMMs the step runs (no
    gradient for the input: the first layer's data gradient is skipped)."""
    ceiling = next((r["tflops"] for r in records if r.get("ceiling") == "gemm_float16"), None)
    weights = sum(o * i for o, i in MLP_LARGE_LAYERS)
    model = 6 * weights * MLP_LARGE_BATCH
    executed = model - 2 * MLP_LARGE_LAYERS[0][0] * MLP_LARGE_LAYERS[0][1] * MLP_LARGE_BATCH
    lines = []
    for w, m, t, o in rows:
        if w != "mlp_large" or m != "single":
            continue
        for impl, r in (("pytorch", t), ("mptrain", o)):
            ms = r.get("step_ms_median")
            if not ms:
                continue
            rates = [flops / ms / 1e9 for flops in (model, executed)]
            share = [f"{100 * x / ceiling:.1f}%" if ceiling else "n/a" for x in rates]
            lines.append(f"| {impl} | {ms} | {rates[0]:.0f} ({share[0]}) | {rates[1]:.0f} ({share[1]}) |")
    if lines:
        print(f"\nmlp_large single, against the fp16 GEMM ceiling of {ceiling} TFLOP/s measured in this call:")
        print("| impl | ms/step | model TFLOP/s (6 x weights x batch) | executed GEMM TFLOP/s |")
        print("|---|---|---|---|")
        print("\n".join(lines))


def scaling(mode, run, single):
    """ddp: single step time / ddp step time; dp: samples/s over single's."""
    if "step_ms_median" not in run or "step_ms_median" not in single:
        return "n/a"
    if mode == "ddp":
        return f"{single['step_ms_median'] / run['step_ms_median']:.3f}"
    return f"{run['samples_per_s'] / single['samples_per_s']:.2f}x"


def print_scaling(rows):
    """Multi-GPU modes against each side's own single-GPU run: ddp's weak
    scaling efficiency (single step time / ddp step time, same per-GPU
    batch) and dp's throughput gain (dp samples/s / single samples/s)."""
    single = {(w, impl): r for w, m, t, o in rows if m == "single" for impl, r in (("pytorch", t), ("mptrain", o))}
    lines = []
    for w, m, t, o in rows:
        if m == "single":
            continue
        cells = [scaling(m, r, single.get((w, impl), {})) for impl, r in (("pytorch", t), ("mptrain", o))]
        lines.append(f"| {w} | {m} | {o.get('gpus', '-')} | {cells[0]} | {cells[1]} |")
    if lines:
        print("\n| workload | mode | GPUs | PyTorch vs its single GPU | mptrain vs its single GPU |")
        print("|---|---|---|---|---|")
        print("\n".join(lines))
        print("(ddp: weak-scaling efficiency, single step time / ddp step time; dp: throughput over one GPU)")


def variant_options(variant):
    """'grad-transit=f16,registered-buffers' -> ['--grad-transit', 'f16', '--registered-buffers']"""
    options = []
    for item in variant.split(","):
        name, _, value = item.partition("=")
        options += ["--" + name] + ([value] if value else [])
    return options


def print_variant_scaling(rows, variants):
    """mptrain with other mpt-bench options beside its default options' run
    of the same workload, mode and precision: single mode as a speed-up
    over the default, dp and ddp against mptrain's own single-GPU run."""
    if not variants:
        return
    plain = {(w, m, p): o for w, m, t, o, c, p in rows}

    def versus(m, run, key):
        if m == "single":
            base = plain.get(key, {})
            ok = "step_ms_median" in run and "step_ms_median" in base
            return f"{base['step_ms_median'] / run['step_ms_median']:.3f}x faster" if ok else "n/a"
        return scaling(m, run, plain.get((key[0], "single", key[2]), {}))

    print("\n| workload | precision | mode | mpt-bench options | ms/step | vs default (single) or its single GPU "
          "| peak MB | default: ms/step | peak MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for w, m, variant, r, p in variants:
        base = plain.get((w, m, p), {})
        err = f" {r['error']}" if "error" in r else ""
        print(f"| {w} | {p} | {m} | `{variant}` | {r.get('step_ms_median', 'n/a')} | {versus(m, r, (w, m, p))} "
              f"| {r.get('peak_mem_mb', '-')} | {base.get('step_ms_median', 'n/a')} | {base.get('peak_mem_mb', '-')} "
              f"|{err}")


def print_allreduce(lines):
    """mpt-bench --mode allreduce: microseconds (and bus GB/s) per all-reduce,
    a row per dtype and size, a column per way."""
    if not lines:
        return
    ways = sorted({l["way"] for l in lines if "way" in l}, key=["nccl", "symmetric", "peer"].index)
    cells = {(l["dtype"], l["bytes"], l["way"]): l for l in lines if "way" in l}
    gpus = next((l["gpus"] for l in lines if "gpus" in l), "?")
    print(f"\nOne all-reduce over {gpus} GPUs (mpt-bench --mode allreduce; us, bus GB/s):")
    print("| dtype | KiB | " + " | ".join(ways) + " |")
    print("|---|---|" + "---|" * len(ways))
    for dtype, size in sorted({(d, b) for d, b, _ in cells}):
        row = []
        for w in ways:
            c = cells.get((dtype, size, w))
            row.append(f"{c['us_median']:.1f} ({c['bus_gb_per_s']:.0f})" if c else "n/a")
        print(f"| {dtype} | {size // 1024} | " + " | ".join(row) + " |")
    for l in lines:
        if "error" in l:
            print(f"allreduce: {l['error']}")


if __name__ == "__main__":
    main()
