#!/usr/bin/env python3
"""transformers' LlamaDecoderLayer, forward + backward on the CPU: the reference that
`cargo run --release --example bench_llama_layer` is measured beside (same shapes, same cores).

    .venv/bin/python scripts/bench_llama_layer.py [--threads 2] [--iters 20] [--dtype f32|bf16]

Prints the median milliseconds of one step (forward, backward of sum(out * r)) after warm-up.
"""
import argparse
import statistics
import time

import torch
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama as m

from bench_llama_shape import B, HEADS, HIDDEN, INTER, KV_HEADS, T

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--iters", type=int, default=20)
p.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
a = p.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                  intermediate_size=INTER, max_position_embeddings=4096, attn_implementation="sdpa")
layer = m.LlamaDecoderLayer(cfg, layer_idx=0)
emb = m.LlamaRotaryEmbedding(cfg)
x = torch.randn(B, T, HIDDEN, requires_grad=True)
r = torch.randn(B, T, HIDDEN)
pos = torch.arange(T)[None].expand(B, T)
mask = torch.full((T, T), float("-inf")).triu(1)[None, None]


def step():
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
        cos, sin = emb(x, pos)
        y = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=(cos, sin))
        loss = (y.float() * r).sum()
    loss.backward()
    layer.zero_grad(set_to_none=True)
    x.grad = None


for _ in range(3):
    step()
times = []
for _ in range(a.iters):
    t0 = time.perf_counter()
    step()
    times.append((time.perf_counter() - t0) * 1e3)
print(f"transformers LlamaDecoderLayer {a.dtype} B={B} T={T} hidden={HIDDEN}: {statistics.median(times):.2f} ms")
