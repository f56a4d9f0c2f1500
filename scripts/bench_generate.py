"""transformers' greedy `generate` of a Hugging Face folder, timed, beside
`finetune_lm --prompt` (the same model, prompt length, new tokens and rows):

    python scripts/bench_generate.py DIR --prompt-len 128 --new 128 --rows 2 --threads 2

The prompt is token ids 0..prompt_len-1 taken from the characters wgpipe's synthetic corpus
uses (the ids `finetune_lm` gives a prompt of those characters without a tokenizer); the figure
is new tokens per second per row, median of --rounds, with the KV cache (transformers' default)
and without it (use_cache=False).
"""
import argparse
import statistics
import time

import torch
import transformers

p = argparse.ArgumentParser()
p.add_argument("dir")
p.add_argument("--prompt-len", type=int, default=128)
p.add_argument("--new", type=int, default=128)
p.add_argument("--rows", type=int, default=2)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--no-cache-too", action="store_true")
a = p.parse_args()
torch.set_num_threads(a.threads)
model = transformers.AutoModelForCausalLM.from_pretrained(a.dir, dtype=torch.float32).eval()
ids = torch.tensor([[(i * 7) % 27 + 1 for i in range(a.prompt_len)]] * a.rows)
for cache in [True] + ([False] if a.no_cache_too else []):
    times = []
    for _ in range(a.rounds):
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False,
                                 use_cache=cache, pad_token_id=0)
        times.append(time.perf_counter() - t)
    assert out.shape[1] == a.prompt_len + a.new
    med = statistics.median(times)
    print(f"transformers generate, use_cache={cache}: {a.new / med:.1f} tokens/s per row "
          f"({a.rows} rows, median of {a.rounds}: {med:.2f} s)")
