//! Small models and data the integration tests share.

use super::*;

/// A small MLP as 8 layers: Linear, ReLU, Linear, GELU, LayerNorm, Linear, ReLU, Linear.
/// Widths `input -> width -> ... -> out` (different at each boundary so byte counts differ).
pub fn mlp(input: usize, width: usize, out: usize, seed: u64) -> Vec<Box<dyn Module>> {
    let d = Device::cpu();
    let w2 = width + 4;
    vec![
        Box::new(Linear::new(input, width, seed, &d).unwrap()),
        Box::new(Relu),
        Box::new(Linear::new(width, w2, seed + 1, &d).unwrap()),
        Box::new(Gelu::Tanh),
        Box::new(LayerNorm::new(w2, &d).unwrap()),
        Box::new(Linear::new(w2, width, seed + 2, &d).unwrap()),
        Box::new(Relu),
        Box::new(Linear::new(width, out, seed + 3, &d).unwrap()),
    ]
}

/// A deeper Transformer LM (6 blocks: 9 layers), enough for 4 devices x 2 chunks.
pub fn deep_transformer(dropout: f32, seed: u64) -> Vec<Box<dyn Module>> {
    TransformerLm {
        layers: 6,
        ..transformer_cfg(dropout)
    }
    .build(seed, &Device::cpu())
    .unwrap()
}

/// The Transformer LM of the tests: vocab 16, d 16, 2 heads, 2 blocks, sequences of 6:
/// 5 elements (embedding, 2 blocks, LayerNorm, head).
pub fn transformer_cfg(dropout: f32) -> TransformerLm {
    TransformerLm {
        vocab: 16,
        d_model: 16,
        heads: 2,
        layers: 2,
        seq_len: 6,
        dropout,
        tie_embeddings: true,
    }
}

pub fn transformer(dropout: f32, seed: u64) -> Vec<Box<dyn Module>> {
    transformer_cfg(dropout)
        .build(seed, &Device::cpu())
        .unwrap()
}

/// Deterministic normal data `[shape]` on the CPU.
pub fn normal_data(shape: &[usize], seed: u64) -> Tensor {
    Tensor::rand_normal(shape, 0.0, 1.0, seed, &Device::cpu()).unwrap()
}

/// Integer ids in `0..vocab` as f32, `[n, t]`, from a fixed formula.
pub fn token_ids(n: usize, t: usize, vocab: usize, salt: usize) -> Tensor {
    let v: Vec<f32> = (0..n * t)
        .map(|i| ((i * 7 + salt * 13 + (i / t) * 3) % vocab) as f32)
        .collect();
    Tensor::from_vec(v, &[n, t], &Device::cpu()).unwrap()
}

/// Layers per stage, as even as possible (the first stages get the extra layers).
pub fn even_balance(layers: usize, k: usize) -> Vec<usize> {
    (0..k)
        .map(|i| layers / k + usize::from(i < layers % k))
        .collect()
}
