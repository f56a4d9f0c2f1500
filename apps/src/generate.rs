//! Text generation through the pipeline: each new token a forward-only round
//! (`Pipeline::predict`: the last stage keeps the logits of the last position and hands them to
//! every rank, which all draw the same token from the same generator, so no rank needs the whole
//! model), drawn greedily or from the softmax at a temperature, optionally within the top k
//! tokens or the top-p nucleus.

use crate::error::AppResult;
use crate::pipeline::Pipeline;
use crate::tensor::rng::SplitMix64;
use crate::tensor::{Device, Tensor};

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
}

impl Sampling {
    pub fn greedy() -> Sampling {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// `new_tokens` tokens after `prompt` (every one of the pipeline's M rows starts from it; row
/// 0's continuation is returned), each drawn from the logits of a model of `vocab` tokens that
/// sees at most the last `context` tokens.
pub fn generate(
    pipe: &mut Pipeline,
    prompt: &[u32],
    new_tokens: usize,
    context: usize,
    vocab: usize,
    sampling: &Sampling,
) -> AppResult<Vec<u32>> {
    if prompt.is_empty() {
        crate::bail!("the prompt is empty: give at least one token");
    }
    let rows = pipe.num_micro_batches();
    let mut seqs: Vec<Vec<u32>> = vec![prompt.to_vec(); rows];
    let mut rng = SplitMix64::new(sampling.seed ^ 0x5EED);
    for _ in 0..new_tokens {
        let t = seqs[0].len().min(context);
        let ids: Vec<f32> = seqs
            .iter()
            .flat_map(|s| s[s.len() - t..].iter().map(|&i| i as f32))
            .collect();
        let ids = Tensor::from_vec(ids, &[rows, t], &Device::cpu())?;
        let last = pipe
            .predict(&ids, &move |logits| logits.narrow(1, t - 1, 1))?
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
