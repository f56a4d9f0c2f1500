"""A random-initialized Llama written as transformers writes it (config.json, bf16 shards and
model.safetensors.index.json), for the loading and memory benchmarks: nothing here can
download real weights. Default: TinyLlama-1.1B's shape (1.10B parameters, 2.2 GB in bf16).

    python scripts/make_random_llama.py OUT_DIR [--layers 22] [--hidden 2048] [--shard 500MB]

Needs torch and transformers (the venv of scripts/hf_models_reference.py).
"""
import argparse

import torch
import transformers

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--layers", type=int, default=22)
p.add_argument("--hidden", type=int, default=2048)
p.add_argument("--intermediate", type=int, default=5632)
p.add_argument("--heads", type=int, default=32)
p.add_argument("--kv-heads", type=int, default=4)
p.add_argument("--vocab", type=int, default=32000)
p.add_argument("--shard", default="500MB")
a = p.parse_args()

torch.manual_seed(0)
config = transformers.LlamaConfig(
    vocab_size=a.vocab,
    hidden_size=a.hidden,
    intermediate_size=a.intermediate,
    num_hidden_layers=a.layers,
    num_attention_heads=a.heads,
    num_key_value_heads=a.kv_heads,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
torch.set_default_dtype(torch.bfloat16)
model = transformers.LlamaForCausalLM(config).eval()
n = sum(t.numel() for t in model.parameters())
model.save_pretrained(a.out, max_shard_size=a.shard, safe_serialization=True)
print(f"{a.out}: {n / 1e9:.3f}B parameters in bf16 shards of at most {a.shard}")
