#!/usr/bin/env python3
"""A tiny Llama with its own tokenizer.json (models/tests/fixtures/llama_tok), for the tokenizer,
fine-tuning and generation tests.

    .venv/bin/python scripts/hf_tokenizer_reference.py   (the venv of hf_models_reference.py,
                                                          plus `pip install tokenizers`)

- tokenizer.json: a byte-level BPE (GPT-2's pre-tokenizer and decoder) of 384 tokens trained
  with the `tokenizers` library on the text below, `<|endoftext|>` its one special token;
- tokenizer_reference.json: texts with Unicode, whitespace runs and the special token, with the
  ids `tokenizers` gives them (no special tokens added) and the text decoded back;
- config.json + model.safetensors: a LlamaForCausalLM of that vocabulary (f32), and in
  generate_reference.json the ids transformers' greedy `generate` continues a prompt with.
"""
import json
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = os.path.join(os.path.dirname(__file__), "..", "models", "tests", "fixtures", "llama_tok")
os.makedirs(ROOT, exist_ok=True)

CORPUS = [
    "The pipeline cuts the model into stages, and each stage runs on its own device.",
    "Micro-batches flow through the stages; activations are computed again in the backward pass.",
    "Gradients of every micro-batch are added up and applied once per mini-batch.",
    "Une phrase en français, avec des accents : élève, château, naïve, cœur.",
    "Ein Satz auf Deutsch: Größe, Übung, Straße, schön.",
    "日本語の文章も少し含めます。東京、大阪、京都。",
    "Emoji and symbols: 🙂 🚀 ∑ ≤ ≥ → ©, tabs\tand  double  spaces.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and code: fn main() { println!(\"hi\"); }",
]

tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(
    vocab_size=384,
    special_tokens=["<|endoftext|>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
)
tok.train_from_iterator(CORPUS * 20, trainer)
tok.save(os.path.join(ROOT, "tokenizer.json"))

TEXTS = [
    "The stages run on their own devices.",
    "naïve café — 日本語 🙂 and a new word: zyxwv",
    "runs   of    spaces\tand\t\ttabs\n\nand blank lines\n",
    "one document<|endoftext|>the next one",
    "",
]
ref = []
for t in TEXTS:
    ids = tok.encode(t, add_special_tokens=False).ids
    ref.append({"text": t, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)})
with open(os.path.join(ROOT, "tokenizer_reference.json"), "w") as f:
    json.dump({"vocab_size": tok.get_vocab_size(), "end_of_text": tok.token_to_id("<|endoftext|>"),
               "cases": ref}, f, ensure_ascii=False, indent=1)

torch.manual_seed(11)
eot = tok.token_to_id("<|endoftext|>")
config = LlamaConfig(
    attn_implementation="eager",
    vocab_size=tok.get_vocab_size(),
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    bos_token_id=eot,
    eos_token_id=eot,
)
model = LlamaForCausalLM(config).eval()
with torch.no_grad():
    for n, p in model.named_parameters():
        if "norm" in n:
            p.copy_(1.0 + 0.2 * torch.randn_like(p))
        else:
            p.mul_(8.0)  # sharper logits, so that greedy choices are not near-ties
model.save_pretrained(ROOT, safe_serialization=True)

prompt = tok.encode("The pipeline", add_special_tokens=False).ids
out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                     eos_token_id=None, pad_token_id=eot)
with torch.no_grad():
    logits = model(torch.tensor([prompt])).logits[0, -1]
    top2 = torch.topk(logits, 2).values
with open(os.path.join(ROOT, "generate_reference.json"), "w") as f:
    json.dump({"prompt": prompt, "generated": out[0, len(prompt):].tolist(),
               "first_margin": float(top2[0] - top2[1])}, f, indent=1)
print(sorted(os.listdir(ROOT)), "vocab", tok.get_vocab_size())
