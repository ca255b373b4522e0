#!/usr/bin/env python3
"""How much of an all-reduce hides behind GEMMs on this machine: times an
fp16 8192^3 GEMM alone, an f32 all-reduce of 256 MB alone, and two GEMMs
with the all-reduce beside them (another stream), on two GPUs.
  torchrun --nproc_per_node 2 overlap_probe.py"""
import os
import torch
import torch.distributed as dist


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


def main():
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    g = torch.randn(64 << 20, device="cuda")  # 256 MB of f32
    side = torch.cuda.Stream()
    gemm = lambda: torch.mm(a, b)

    def ar():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dist.all_reduce(g)
        torch.cuda.current_stream().wait_stream(side)

    def both():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dist.all_reduce(g)
        torch.mm(a, b)
        torch.mm(a, b)
        torch.cuda.current_stream().wait_stream(side)

    t_gemm = timed(gemm)
    t_ar = timed(ar)
    t_both = timed(both)
    if rank == 0:
        print(f"overlap_probe: gemm {t_gemm:.3f} ms ({2 * 8192**3 / t_gemm / 1e9:.0f} TFLOP/s), "
              f"all-reduce 256 MB {t_ar:.3f} ms ({256 / t_ar:.0f} GB/s algbw), 2 gemms + all-reduce together "
              f"{t_both:.3f} ms (serial {2 * t_gemm + t_ar:.3f}, perfect overlap {2 * t_gemm:.3f}); "
              f"hidden {(2 * t_gemm + t_ar - t_both) / t_ar:.0%} of the all-reduce", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
