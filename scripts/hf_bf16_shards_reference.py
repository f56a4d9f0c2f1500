#!/usr/bin/env python3
"""A small Llama saved as transformers saves a bf16 checkpoint: bf16 shards and
model.safetensors.index.json (models/tests/fixtures/llama_bf16_shards), with reference values
for models/tests/hf_models.rs.

    .venv/bin/python scripts/hf_bf16_shards_reference.py   (the venv of hf_models_reference.py)

reference.safetensors holds a batch of token ids and next tokens; transformers' logits, loss and
every named parameter's gradient computed in float64 from the bf16 weights (each bf16 value is
an exact f32 and f64, so this is the model the file holds); and `logits_bf16`, transformers' own
logits computing in bf16, whose distance from the float64 logits is what bf16 compute costs
there (the tests hold wgpipe's bf16 compute to a small multiple of it).
"""
import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = os.path.join(os.path.dirname(__file__), "..", "models", "tests", "fixtures")
B, T = 2, 8

torch.manual_seed(7)
config = LlamaConfig(
    attn_implementation="eager",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    rope_theta=20000.0,
)
model = LlamaForCausalLM(config).eval()
with torch.no_grad():
    for n, p in model.named_parameters():
        if "norm" in n:
            p.copy_(1.0 + 0.2 * torch.randn_like(p))
half = model.to(torch.bfloat16)
folder = os.path.join(ROOT, "llama_bf16_shards")
# Shards of 8 KB: about one per decoder-layer matrix, so that a stage's layers span files.
half.save_pretrained(folder, safe_serialization=True, max_shard_size="8KB")

ids = torch.randint(0, config.vocab_size, (B, T))
targets = torch.randint(0, config.vocab_size, (B, T))
with torch.no_grad():
    logits_bf16 = half(input_ids=ids).logits.double()
wide = LlamaForCausalLM(config).double().eval()
wide.load_state_dict({k: v.double() for k, v in half.state_dict().items()})
logits = wide(input_ids=ids).logits
loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), targets.reshape(-1))
loss.backward()
out = {
    "input_ids": ids.double(),
    "targets": targets.double(),
    "logits": logits.detach(),
    "logits_bf16": logits_bf16,
    "loss": loss.detach().reshape(1),
}
for n, p in wide.named_parameters():
    out[f"grad.{n}"] = p.grad.detach().clone()
meta = {"transformers": __import__("transformers").__version__, "torch": torch.__version__}
save_file(
    {k: v.contiguous() for k, v in out.items()},
    os.path.join(folder, "reference.safetensors"),
    metadata={"versions": json.dumps(meta)},
)
print(sorted(os.listdir(folder)))
