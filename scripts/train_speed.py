#!/usr/bin/env python3
"""Times mpt-train itself (the main job, data loading and all) on this
machine's GPU: each model with its step as a CUDA graph and eagerly, and
optionally with another build's mpt-train, back to back in one call.
Prints a Markdown table of the steady-state step time (the last logging
window, past the captures) and the run's test accuracy.

  scripts/train_speed.py --build build-stage [--baseline prev/mpt-train] [--models mlp,cnn,gpt]

A baseline is run as it is (without --cuda-graph, which it may not know);
its shared library comes from its own folder when one lies beside it.
Metrics files go to $OUT (or ./train-speed)."""
import argparse
import json
import os
import subprocess
import sys

# Steps, logging window and extra options per model: enough steps for a
# few windows past the capture, few enough for one device call.
RUNS = {
    "mlp": (600, 200, []),
    "mlp-accum": (300, 100, ["--model", "mlp", "--accumulation", "4"]),
    "mlp-sgd": (600, 200, ["--model", "mlp", "--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.05"]),
    "cnn": (400, 100, ["--model", "cnn"]),
    "gpt": (150, 50, ["--model", "gpt"]),
}


def train(binary, name, variant, extra, out, env):
    steps, window, options = RUNS[name]
    metrics = os.path.join(out, f"{name}-{variant}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [binary, "--device", "cuda", "--progress", "none", "--steps", str(steps), "--log-every", str(window),
           "--eval-batches", "4", "--metrics", metrics] + options + extra
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if p.returncode != 0:
        return {"error": f"exit {p.returncode}: " + " | ".join((p.stderr or p.stdout).strip().splitlines()[-3:])}
    lines = [json.loads(l) for l in open(metrics)]
    last = [l for l in lines if l["event"] == "step"][-1]
    end = [l for l in lines if l["event"] == "end"][-1]
    epoch = [l for l in lines if l["event"] == "epoch"][-1]
    return {"step_ms": last["step_ms"], "samples_per_s": last["samples_per_s"], "accuracy": end["eval_accuracy"],
            "seconds": end["seconds"], "replays": epoch.get("graph_replays", 0)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", required=True, help="build (or staged) folder holding tools/mpt-train/mpt-train")
    ap.add_argument("--baseline", help="another mpt-train binary to time alongside")
    ap.add_argument("--models", default=",".join(RUNS), help="comma-separated: " + ", ".join(RUNS))
    args = ap.parse_args()
    out = os.environ.get("OUT", "train-speed")
    os.makedirs(out, exist_ok=True)
    binary = os.path.join(args.build, "tools", "mpt-train", "mpt-train")
    env = dict(os.environ)
    variants = [("graph", binary, ["--cuda-graph", "on"], env), ("eager", binary, ["--cuda-graph", "off"], env)]
    if args.baseline:
        base_env = dict(os.environ)
        lib_dir = os.path.dirname(os.path.abspath(args.baseline))
        if any(f.startswith("libmptrain.so") for f in os.listdir(lib_dir)):
            base_env["LD_LIBRARY_PATH"] = lib_dir + ":" + base_env.get("LD_LIBRARY_PATH", "")
        variants.append(("baseline", args.baseline, [], base_env))
    print("| run | variant | ms/step | samples/s | test accuracy | run seconds | graph replays |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        for variant, path, extra, variant_env in variants:
            r = train(path, name, variant, extra, out, variant_env)
            if "error" in r:
                print(f"| {name} | {variant} | {r['error']} | | | | |", flush=True)
                continue
            print(f"| {name} | {variant} | {r['step_ms']:.3f} | {r['samples_per_s']:.0f} | {r['accuracy']:.4f} | "
                  f"{r['seconds']:.1f} | {r['replays']} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
