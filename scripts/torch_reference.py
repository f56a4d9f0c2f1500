#!/usr/bin/env python3
"""PyTorch CPU reference for `bench_train`: the same three training steps, timed the same way.

Workloads (definitions as /work/shared/reference/torch_bench.py and torch_mainjob.py):
  mlp   4 x Linear(1024) + ReLU, batch 256, MSE, SGD lr 1e-3
  block pre-LN decoder block d256 h4 (fused QKV), batch 8 x 128, causal mask, exact GELU, MSE,
        SGD lr 1e-3
  lm    the main job's TransformerLm (vocab 28, d 64, 4 heads, 4 blocks, context 64, tanh GELU,
        untied head), batch 32, cross-entropy, AdamW lr 3e-4

Prints one line per workload: `<workload> <steps/s>` (median step time after warm-up; each step
ends with `loss.item()`, which waits for the device). `--device cuda` runs them on a GPU, f32 as
on the CPU (PyTorch keeps TF32 off for f32 matmuls by default): scripts/gpu-check.sh's reference.
usage: torch_reference.py --workloads mlp,block,lm [--threads 2] [--seconds 3] [--max-steps 200]
       [--device cpu|cuda]
"""
import argparse
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(1024, 1024) for _ in range(4))

    def forward(self, x):
        for i, l in enumerate(self.layers):
            x = l(x)
            if i + 1 < len(self.layers):
                x = F.relu(x)
        return x


class Block(nn.Module):
    """torch_bench.py's W3 block: pre-LN, fused QKV, causal mask, exact GELU."""

    def __init__(self, d=256, h=4):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        hd = d // self.h
        q, k, v = (z.view(b, t, self.h, hd).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(d, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        y = F.softmax(att.masked_fill(mask, float("-inf")), dim=-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class LmBlock(nn.Module):
    """torch_mainjob.py's block: separate q, k, v, SDPA (causal), tanh GELU."""

    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        a = self.ln1(x)
        q, k, v = (m(a).view(b, t, self.h, d // self.h).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class Lm(nn.Module):
    def __init__(self, vocab=28, d=64, h=4, layers=4, seq=64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*(LmBlock(d, h) for _ in range(layers)))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, x):
        h = self.tok(x) + self.pos.weight[: x.shape[1]]
        return self.head(self.ln(self.blocks(h)))


def workload(name, device):
    torch.manual_seed(0)
    if name == "mlp":
        m = Mlp().to(device)
        x, y = torch.randn(256, 1024, device=device), torch.randn(256, 1024, device=device)
        return m, torch.optim.SGD(m.parameters(), lr=1e-3), lambda: F.mse_loss(m(x), y)
    if name == "block":
        m = Block().to(device)
        x, y = torch.randn(8, 128, 256, device=device), torch.randn(8, 128, 256, device=device)
        return m, torch.optim.SGD(m.parameters(), lr=1e-3), lambda: F.mse_loss(m(x), y)
    if name == "lm":
        m = Lm().to(device)
        x, y = (torch.randint(0, 28, (32, 64), device=device) for _ in range(2))
        loss = lambda: F.cross_entropy(m(x).reshape(-1, 28), y.reshape(-1))
        return m, torch.optim.AdamW(m.parameters(), lr=3e-4), loss
    raise SystemExit(f"unknown workload {name!r} (mlp, block, lm)")


def steps_per_second(name, seconds, max_steps, warmup, device):
    _, opt, loss_fn = workload(name, device)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(warmup):
        step()
    times, start = [], time.perf_counter()
    while len(times) < max_steps and (not times or time.perf_counter() - start < seconds):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    assert math.isfinite(loss)
    return 1.0 / statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="mlp,block,lm")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    for name in a.workloads.split(","):
        print(f"{name} {steps_per_second(name, a.seconds, a.max_steps, a.warmup, a.device):.4f}", flush=True)


if __name__ == "__main__":
    main()
