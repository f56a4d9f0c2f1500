"""The shape both sides of the decoder-layer benchmark time (examples/bench_llama_layer.rs has
the same numbers): a small Llama's layer, grouped-query attention 8 / 4 heads of 64."""
B, T, HIDDEN, HEADS, KV_HEADS, INTER = 4, 256, 512, 8, 4, 1408
