#!/usr/bin/env python3
"""Small random Hugging Face models and their reference values, for models/tests/hf_models.rs.

    python3 -m venv .venv && .venv/bin/pip install torch transformers safetensors
    .venv/bin/python scripts/hf_models_reference.py

Writes, under models/tests/fixtures/, one folder per model as `save_pretrained` writes it
(config.json, model.safetensors in f32) and beside it `reference.safetensors`: a batch of token
ids and next tokens, and transformers' logits, mean cross-entropy loss and the gradient of every
named parameter for that batch, computed in float64 on a copy of the model. The models:

- llama_gqa: LlamaForCausalLM, 2 layers, 4 query and 2 key/value heads, untied head, llama3
  rope scaling with rope_theta 500000, rms_norm_eps 1e-5;
- llama_tied: LlamaForCausalLM with tie_word_embeddings, default rope, 1 layer;
- gpt2: GPT2LMHeadModel, 2 blocks, 4 heads, tied head, its Conv1D weights stored [in, out].
"""
import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

ROOT = os.path.join(os.path.dirname(__file__), "..", "models", "tests", "fixtures")
B, T = 2, 6

MODELS = {
    "llama_gqa": dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "llama_tied": dict(
        vocab_size=48,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    ),
}

GPT2 = dict(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=4)

for seed, (name, kw) in enumerate(list(MODELS.items()) + [("gpt2", GPT2)]):
    torch.manual_seed(seed)
    if name == "gpt2":
        config = GPT2Config(attn_implementation="eager", **kw)
        cls = GPT2LMHeadModel
    else:
        config = LlamaConfig(attn_implementation="eager", **kw)
        cls = LlamaForCausalLM
    model = cls(config).eval()
    with torch.no_grad():
        # Random norm weights too, so that a norm loaded as ones would show.
        for n, p in model.named_parameters():
            if "norm" in n or ".ln_" in n:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    folder = os.path.join(ROOT, name)
    model.save_pretrained(folder, safe_serialization=True)

    ids = torch.randint(0, config.vocab_size, (B, T))
    targets = torch.randint(0, config.vocab_size, (B, T))
    wide = cls(config).double().eval()
    wide.load_state_dict(model.state_dict())
    if config.tie_word_embeddings:
        wide.tie_weights()
    logits = wide(input_ids=ids).logits
    loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), targets.reshape(-1))
    loss.backward()
    out = {
        "input_ids": ids.double(),
        "targets": targets.double(),
        "logits": logits.detach(),
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
    print(name, "->", sorted(os.listdir(folder)), "grads:", [n for n in out if n.startswith("grad.")])
