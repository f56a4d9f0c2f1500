#!/usr/bin/env python3
"""Reference values of Llama's and BiT's layers from transformers, torch and timm themselves,
for models/tests/hf_layers.rs.

    python3 -m venv .venv && .venv/bin/pip install torch transformers timm safetensors
    .venv/bin/python scripts/hf_layers_reference.py   # writes models/tests/fixtures/hf_layers.safetensors

Everything is computed by transformers' own modules in float64 (the reference the f32 tests
compare against): LlamaRotaryEmbedding's inverse frequencies for the default, linear and llama3
rope types and apply_rotary_pos_emb at two position offsets; LlamaRMSNorm; LlamaMLP; and one
LlamaDecoderLayer with grouped-query attention (4 query heads, 2 key/value heads), its output
and the gradients of every parameter and of the input for the loss sum(out * r); and BiT's
torch.nn.GroupNorm and timm's StdConv2d (weight standardization, eps 1e-8, stride 2), their
outputs and gradients alike. Inputs and weights are stored beside them (f64), with the config
as metadata."""
import json
import os

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama as m

torch.manual_seed(0)
DT = torch.float64
out = {}

HIDDEN, HEADS, KV_HEADS, INTER, T, B = 16, 4, 2, 24, 5, 2
HEAD_DIM = HIDDEN // HEADS
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
}


def config(rope, **kw):
    return LlamaConfig(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        intermediate_size=INTER,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        rope_parameters=dict(rope),
        attn_implementation="eager",
        **kw,
    )


# Rotary embeddings: the inverse frequencies (f32, as transformers keeps them) and q rotated at
# positions 0..T and 3..3+T, computed in f64 from those frequencies.
q = torch.randn(B, HEADS, T, HEAD_DIM, dtype=DT)
out["rope.q"] = q
for name, rope in ROPES.items():
    # head_dim 16 for the frequencies, so llama3's three bands all occur.
    emb = m.LlamaRotaryEmbedding(config(rope, head_dim=16))
    out[f"rope.{name}.inv_freq"] = emb.inv_freq.clone()
    emb_q = m.LlamaRotaryEmbedding(config(rope))
    for start in (0, 3):
        pos = torch.arange(start, start + T)[None].expand(B, T)
        cos, sin = emb_q(q, pos)
        rotated, _ = m.apply_rotary_pos_emb(q, q, cos, sin)
        out[f"rope.{name}.from{start}"] = rotated

# RMSNorm and the gated MLP.
x = torch.randn(B, T, HIDDEN, dtype=DT)
out["x"] = x
norm = m.LlamaRMSNorm(HIDDEN, eps=1e-5).to(DT)
with torch.no_grad():
    norm.weight.copy_(torch.randn(HIDDEN, dtype=DT))
out["rms_norm.weight"] = norm.weight.detach().clone()
out["rms_norm.out"] = norm(x).detach()

mlp = m.LlamaMLP(config(ROPES["default"])).to(DT)
for n, p in mlp.named_parameters():
    out[f"mlp.{n}"] = p.detach().clone()
out["mlp.out"] = mlp(x).detach()

# One decoder layer with grouped-query attention and llama3 rope, forward and backward.
cfg = config(ROPES["llama3"])
layer = m.LlamaDecoderLayer(cfg, layer_idx=0).to(DT)
with torch.no_grad():
    for p in layer.parameters():
        p.copy_(torch.randn_like(p) * 0.3)
emb = m.LlamaRotaryEmbedding(cfg)
xl = x.clone().requires_grad_(True)
pos = torch.arange(T)[None].expand(B, T)
cos, sin = emb(xl, pos)
mask = torch.full((T, T), float("-inf"), dtype=DT).triu(1)[None, None]
y = layer(xl, attention_mask=mask, position_ids=pos, position_embeddings=(cos, sin))
r = torch.randn_like(y)
(y * r).sum().backward()
out["layer.r"] = r
out["layer.out"] = y.detach()
out["layer.grad.x"] = xl.grad.detach()
for n, p in layer.named_parameters():
    out[f"layer.{n}"] = p.detach().clone()
    out[f"layer.grad.{n}"] = p.grad.detach().clone()

# BiT's layers: GroupNorm(4 groups, 8 channels) and timm's StdConv2d(8 -> 6, 3x3, stride 2).
from timm.layers import StdConv2d

img = torch.randn(2, 8, 5, 5, dtype=DT, requires_grad=True)
gn = torch.nn.GroupNorm(4, 8, eps=1e-5).to(DT)
conv = StdConv2d(8, 6, kernel_size=3, stride=2, bias=True, eps=1e-8).to(DT)
with torch.no_grad():
    for p in list(gn.parameters()) + list(conv.parameters()):
        p.copy_(torch.randn_like(p))
y = conv(gn(img))
r = torch.randn_like(y)
(y * r).sum().backward()
out["bit.x"] = img.detach().clone()
out["bit.r"] = r
out["bit.out"] = y.detach()
out["bit.gn.out"] = gn(img).detach()
out["bit.grad.x"] = img.grad.detach()
for n, p in list(gn.named_parameters(prefix="gn")) + list(conv.named_parameters(prefix="conv")):
    out[f"bit.{n}"] = p.detach().clone()
    out[f"bit.grad.{n}"] = p.grad.detach().clone()

meta = {
    "hidden": HIDDEN,
    "heads": HEADS,
    "kv_heads": KV_HEADS,
    "intermediate": INTER,
    "rms_norm_eps": 1e-5,
    "ropes": ROPES,
    "transformers": __import__("transformers").__version__,
    "torch": torch.__version__,
    "timm": __import__("timm").__version__,
}
path = os.path.join(os.path.dirname(__file__), "..", "models", "tests", "fixtures")
os.makedirs(path, exist_ok=True)
tensors = {k: v.contiguous() for k, v in out.items()}
save_file(tensors, os.path.join(path, "hf_layers.safetensors"), metadata={"config": json.dumps(meta)})
print(f"wrote {len(tensors)} tensors:", ", ".join(sorted(tensors)))
