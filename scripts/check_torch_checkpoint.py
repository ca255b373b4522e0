#!/usr/bin/env python3
"""Loads an mptrain checkpoint's model weights into the reference PyTorch
model (shared/reference/torch_bench.py's layouts) by name, strictly, and
prints one JSON line per file. Needs torch and safetensors.

  check_torch_checkpoint.py mlp run.safetensors [cnn other.safetensors ...]
"""
import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file


class GPTBlock(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.h = h

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPTMini(nn.Module):
    def __init__(self, vocab, ctx, d, layers, heads):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.Sequential(*[GPTBlock(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)


def reference(kind, state):
    if kind == "mlp":
        return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    if kind == "cnn":
        return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(64 * 7 * 7, 256), nn.ReLU(), nn.Linear(256, 10))
    vocab, d = state["tok.weight"].shape
    ctx = state["pos.weight"].shape[0]
    layers = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
    heads = int(sys.argv[sys.argv.index("--heads") + 1]) if "--heads" in sys.argv else 6
    return GPTMini(vocab, ctx, d, layers, heads)


def main():
    args = [a for a in sys.argv[1:] if a != "--heads"]
    ok = True
    for kind, path in zip(args[0::2], args[1::2]):
        everything = load_file(path)
        state = {k: v for k, v in everything.items() if "/" not in k}  # optimizer/, extra/ stay out
        model = reference(kind, state)
        result = model.load_state_dict(state, strict=True)
        same = all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
        ok &= same and not result.missing_keys and not result.unexpected_keys
        print(json.dumps({"file": path, "model": kind, "tensors": len(state), "loaded_strict": True,
                          "values_equal": same, "other_entries": len(everything) - len(state)}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
