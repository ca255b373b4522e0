#!/usr/bin/env python3
"""The CPU anchor for `mpt-train --model cnn`, in PyTorch: the same network
(models/cnn.cpp: two 3x3 convolutions of 32 and 64 channels, each with ReLU
and 2x2 max pooling, then 3136 -> 256 -> 10), Fashion-MNIST from Debian's
dataset-fashion-mnist normalised as mpt-train does, batch 128, AdamW lr
1e-3, a 100-step warm-up then cosine decay, bf16 autocast or f32. Prints
wall time, the median step and test accuracy as JSON, as
../shared/reference/torch_cpu_train.py does for the MLP.

  /usr/bin/python3 scripts/torch_cpu_cnn.py [--epochs N] [--precision bf16|fp32] [--threads T]"""
import argparse
import gzip
import json
import math
import struct
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=1)
p.add_argument("--precision", default="fp32", choices=["bf16", "fp32"])
p.add_argument("--threads", type=int, default=2)
p.add_argument("--batch", type=int, default=128)
a = p.parse_args()
torch.set_num_threads(a.threads)
D = "/usr/share/datasets/fashion-mnist/"


def idx(name):
    b = gzip.open(D + name).read()
    nd = struct.unpack(">I", b[:4])[0] & 0xff
    dims = struct.unpack(">" + "I" * nd, b[4:4 + 4 * nd])
    return torch.frombuffer(bytearray(b[4 + 4 * nd:]), dtype=torch.uint8).reshape(dims)


t0 = time.time()
mean, std = 0.2860, 0.3530
xtr = (idx("train-images-idx3-ubyte.gz").reshape(-1, 1, 28, 28).float() / 255 - mean) / std
ytr = idx("train-labels-idx1-ubyte.gz").long()
xte = (idx("t10k-images-idx3-ubyte.gz").reshape(-1, 1, 28, 28).float() / 255 - mean) / std
yte = idx("t10k-labels-idx1-ubyte.gz").long()
torch.manual_seed(0)
m = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                  nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                  nn.Flatten(), nn.Linear(64 * 7 * 7, 256), nn.ReLU(), nn.Linear(256, 10))
opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0)
steps_per_epoch = math.ceil(len(xtr) / a.batch)
total, warm = steps_per_epoch * a.epochs, 100
sched = torch.optim.lr_scheduler.LambdaLR(
    opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total - warm))))
bf16 = a.precision == "bf16"
t1 = time.time()
step_times = []
for ep in range(a.epochs):
    perm = torch.randperm(len(xtr))
    for i in range(steps_per_epoch):
        s0 = time.perf_counter()
        ix = perm[i * a.batch:(i + 1) * a.batch]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(m(xtr[ix]).float(), ytr[ix])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        step_times.append(time.perf_counter() - s0)
train_s = time.time() - t1
with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
    acc = (m(xte).argmax(1) == yte).float().mean().item()
step_times.sort()
print(json.dumps(dict(torch=torch.__version__, threads=torch.get_num_threads(), precision=a.precision, steps=total,
                      train_s=round(train_s, 2), total_s=round(time.time() - t0, 2),
                      step_ms_median=round(1e3 * step_times[len(step_times) // 2], 3), test_acc=round(acc, 4))))
