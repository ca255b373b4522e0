#!/usr/bin/env python3
"""One FP8 product, ours (bench_fp8_gemm) against PyTorch's torch._scaled_mm,
the primitive under torchao's float8 training, on the same GPU and the same
E4M3 codes and scales: the f32 results compared element by element, then
the time of each (bf16 output) and their ratio.

  scripts/fp8_vs_torch.py --build build-stage [--sizes 8192x8192x8192 ...]
"""
import argparse
import json
import os
import subprocess
import tempfile
import time

import numpy as np
import torch


def codes(rows, cols, p, q):
    """bench/fp8_gemm.cpp's codes: (i*p + j*q) % 251, NaN's codes moved."""
    i = torch.arange(rows, dtype=torch.int64).unsqueeze(1)
    j = torch.arange(cols, dtype=torch.int64).unsqueeze(0)
    v = (i * p + j * q) % 251
    v = torch.where((v & 0x7F) == 0x7F, v ^ 1, v)
    return v.to(torch.uint8).cuda().view(torch.float8_e4m3fn)


def time_ms(f, reps=20):
    """As bench_fp8_gemm times: rounds of `reps` calls queued back to back,
    the best round's mean, the first round a warm-up."""
    best = float("inf")
    for round in range(4):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            f()
        torch.cuda.synchronize()
        if round > 0:
            best = min(best, (time.perf_counter() - start) * 1e3 / reps)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--sizes", nargs="*", default=["8192x8192x8192", "16384x3072x768", "16384x768x3072", "4096x4096x4096"])
    args = ap.parse_args()
    tool = os.path.join(args.build, "bench", "bench_fp8_gemm")
    sa, sb = torch.tensor(0.25, device="cuda"), torch.tensor(0.5, device="cuda")
    for size in args.sizes:
        m, n, k = (int(x) for x in size.split("x"))
        a, b = codes(m, k, 131, 71), codes(n, k, 37, 113)
        for fast in (False, True):
            with tempfile.NamedTemporaryFile(suffix=".bin") as out:
                run = subprocess.run([tool, str(m), str(n), str(k), out.name, str(int(fast))], capture_output=True,
                                     text=True)
                if run.returncode != 0:
                    print(json.dumps({"size": size, "error": run.stderr.strip()}))
                    continue
                ours = json.loads(run.stdout.strip().splitlines()[-1])
                mine = torch.from_numpy(np.fromfile(out.name, dtype=np.float32).reshape(m, n)).cuda()
            theirs = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32, use_fast_accum=fast)
            diff = (mine - theirs).abs()
            rel = (diff.norm() / theirs.norm()).item()
            torch_ms = time_ms(lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                                        use_fast_accum=fast))
            print(json.dumps({"size": size, "fast_accumulation": fast, "identical": bool(torch.equal(mine, theirs)),
                              "max_abs_diff": diff.max().item(), "rel_diff": rel, "ours_ms": ours["ms"],
                              "torch_ms": round(torch_ms, 4), "ours_over_torch_time": round(ours["ms"] / torch_ms, 3),
                              "torch_tflops": round(2 * m * n * k / torch_ms / 1e9, 1)}))


if __name__ == "__main__":
    main()
