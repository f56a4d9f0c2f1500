#!/usr/bin/env python3
"""A small random BiT ResNetV2 from timm and its reference values, for models/tests/bit.rs.

    python3 -m venv .venv && .venv/bin/pip install torch timm safetensors
    .venv/bin/python scripts/timm_resnetv2_reference.py

timm's ResNetV2 as resnetv2_50x1_bit builds it (the "fixed" stem, StdConv2d with eps 1e-8,
GroupNorm(32) + ReLU, pre-activation bottlenecks, a 1x1-conv head), but two stages of one block
(channels 128 and 256, a stem of 32) and 5 classes, every weight random. Writes
models/tests/fixtures/bit/model.safetensors (its state_dict, timm's names) and
reference.safetensors: a batch of 2 images of 3 x 32 x 32, labels, and timm's logits, mean
cross-entropy and every parameter's gradient, in float64.
"""
import json
import os
from functools import partial

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from timm.layers import StdConv2d
from timm.models.resnetv2 import ResNetV2

torch.manual_seed(0)
kw = dict(
    layers=(1, 1),
    channels=(128, 256),
    stem_chs=32,
    num_classes=5,
    stem_type="fixed",
    conv_layer=partial(StdConv2d, eps=1e-8),
)
model = ResNetV2(**kw).eval()
with torch.no_grad():
    for n, p in model.named_parameters():
        p.copy_(torch.randn_like(p) * (0.2 if "norm" in n and n.endswith("bias") else 1.0))
        if "norm" in n and n.endswith("weight"):
            p.add_(1.0)
folder = os.path.join(os.path.dirname(__file__), "..", "models", "tests", "fixtures", "bit")
os.makedirs(folder, exist_ok=True)
save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(folder, "model.safetensors"))

wide = ResNetV2(**kw).double().eval()
wide.load_state_dict(model.state_dict())
x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
labels = torch.tensor([1, 4])
logits = wide(x)
loss = F.cross_entropy(logits, labels)
loss.backward()
out = {"images": x, "labels": labels.double(), "logits": logits.detach(), "loss": loss.detach().reshape(1)}
for n, p in wide.named_parameters():
    out[f"grad.{n}"] = p.grad.detach().clone()
meta = {"timm": __import__("timm").__version__, "torch": torch.__version__}
save_file(out, os.path.join(folder, "reference.safetensors"), metadata={"versions": json.dumps(meta)})
print(sorted(n for n, _ in model.named_parameters()))
