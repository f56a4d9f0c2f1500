//! Text generation through the pipeline: each new token a forward-only round (the last stage
//! keeps the logits of the last position and hands them to every rank, which all draw the same
//! token from the same generator, so no rank needs the whole model), drawn greedily or from the
//! softmax at a temperature, optionally within the top k tokens or the top-p nucleus. With a
//! KV cache (`Pipeline::predict_cached`) the prompt runs once and each round then carries one
//! token per row, every stage attending to the keys and values it kept; without one each round
//! runs the whole window again (`Pipeline::predict`), for models whose layers keep no cache.

use crate::error::AppResult;
use crate::lm::ids_tensor;
use crate::pipeline::Pipeline;
use crate::tensor::rng::SplitMix64;
use crate::tensor::Tensor;

/// How each next token is drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0: greedy (the most likely token); otherwise softmax(logits / temperature).
    pub temperature: f32,
    /// Draw among the k most likely tokens only (0: all).
    pub top_k: usize,
    /// Draw among the most likely tokens whose probabilities add up to p (1: all).
    pub top_p: f32,
    pub seed: u64,
    /// Decode with a KV cache kept in each stage (the model's attention layers must keep one).
    pub kv_cache: bool,
}

impl Sampling {
    pub fn greedy() -> Sampling {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            kv_cache: true,
        }
    }
}

/// `new_tokens` tokens after `prompt` for `rows` sequences at once (each starts from it, drawn
/// in turn; row 0's continuation is returned; `rows` a multiple of the pipeline's M, which
/// splits them into micro-batches so the stages overlap), each drawn from the logits of a model
/// of `vocab` tokens that sees at most the last `context` tokens.
pub fn generate(
    pipe: &mut Pipeline,
    rows: usize,
    prompt: &[u32],
    new_tokens: usize,
    context: usize,
    vocab: usize,
    sampling: &Sampling,
) -> AppResult<Vec<u32>> {
    if prompt.is_empty() {
        crate::bail!("the prompt is empty: give at least one token");
    }
    let m = pipe.num_micro_batches();
    if rows == 0 || !rows.is_multiple_of(m) {
        crate::bail!("{rows} rows to generate do not split into the pipeline's {m} micro-batches");
    }
    if sampling.kv_cache && prompt.len() + new_tokens > context {
        crate::bail!(
            "the prompt ({} tokens) and {new_tokens} new tokens pass the model's {context} positions: ask for fewer, or generate without the KV cache (a sliding window)",
            prompt.len()
        );
    }
    let mut seqs: Vec<Vec<u32>> = vec![prompt.to_vec(); rows];
    let mut rng = SplitMix64::new(sampling.seed ^ 0x5EED);
    for step in 0..new_tokens {
        // With the cache: the prompt at position 0, then the token drawn last at its own
        // position; without: the last `context` tokens, every time.
        let (from, position) = if sampling.kv_cache && step > 0 {
            (seqs[0].len() - 1, Some(seqs[0].len() - 1))
        } else if sampling.kv_cache {
            (0, Some(0))
        } else {
            (seqs[0].len() - seqs[0].len().min(context), None)
        };
        let t = seqs[0].len() - from;
        let ids: Vec<u32> = seqs
            .iter()
            .flat_map(|s| s[from..].iter().copied())
            .collect();
        let ids = ids_tensor(&ids, &[rows, t])?;
        let head = move |logits: &Tensor| logits.narrow(1, t - 1, 1);
        let last = match position {
            Some(p) => pipe.predict_cached(&ids, p, &head)?,
            None => pipe.predict(&ids, &head)?,
        }
        .to_vec()?;
        for (r, s) in seqs.iter_mut().enumerate() {
            s.push(pick(&last[r * vocab..(r + 1) * vocab], sampling, &mut rng));
        }
    }
    Ok(seqs.swap_remove(0).split_off(prompt.len()))
}

/// One token from `logits` as `s` asks.
pub fn pick(logits: &[f32], s: &Sampling, rng: &mut SplitMix64) -> u32 {
    let argmax = logits
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i);
    if s.temperature <= 0.0 {
        return argmax as u32;
    }
    let m = logits[argmax];
    let mut w: Vec<f64> = logits
        .iter()
        .map(|&l| (((l - m) / s.temperature) as f64).exp())
        .collect();
    if s.top_k > 0 || s.top_p < 1.0 {
        keep_top(&mut w, s.top_k, s.top_p);
    }
    let mut u = rng.unit() * w.iter().sum::<f64>();
    for (i, wi) in w.iter().enumerate() {
        u -= wi;
        if u <= 0.0 && *wi > 0.0 {
            return i as u32;
        }
    }
    argmax as u32
}

/// Zeroes every weight outside the `k` largest (0: no limit) and outside the smallest set of
/// largest weights holding `p` of the total (ties kept together, as transformers keeps them).
fn keep_top(w: &mut [f64], k: usize, p: f32) {
    let mut order: Vec<usize> = (0..w.len()).collect();
    order.sort_by(|&a, &b| w[b].total_cmp(&w[a]).then(a.cmp(&b)));
    let total: f64 = w.iter().sum();
    let mut kept = 0;
    let mut mass = 0.0;
    for &i in &order {
        let within_k = k == 0 || kept < k;
        let within_p = mass < p as f64 * total || kept == 0;
        if within_k && within_p {
            mass += w[i];
            kept += 1;
        } else {
            w[i] = 0.0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_largest_and_top_k_and_top_p_draw_only_inside() {
        let logits = [0.1f32, 2.0, -1.0, 1.9, 0.5];
        let mut rng = SplitMix64::new(1);
        assert_eq!(pick(&logits, &Sampling::greedy(), &mut rng), 1);
        let draws = |top_k, top_p| {
            let s = Sampling {
                temperature: 1.0,
                top_k,
                top_p,
                seed: 0,
                kv_cache: false,
            };
            let mut rng = SplitMix64::new(3);
            (0..2000)
                .map(|_| pick(&logits, &s, &mut rng))
                .collect::<std::collections::BTreeSet<u32>>()
        };
        assert_eq!(draws(2, 1.0), [1, 3].into());
        assert_eq!(draws(0, 1.0), [0, 1, 2, 3, 4].into());
        // softmax: 0.43 and 0.39 for tokens 1 and 3, then 0.10 (token 4): p = 0.5 keeps two.
        assert_eq!(draws(0, 0.5), [1, 3].into());
        assert_eq!(draws(0, 0.01), [1].into());
        assert_eq!(draws(1, 1.0), [1].into());
    }
}
