//! Text from the trained model: each token a forward-only round through the pipeline, drawn
//! greedily or from the softmax at a temperature.

use super::{ids_tensor, TransformerArgs};
use crate::error::AppResult;
use crate::models::data::TextDataset;
use crate::pipeline::Pipeline;
use crate::tensor::rng::SplitMix64;

/// Text sampled from the trained model, after a prompt from the start of the held-out text
/// (or "the " on the built-in corpus).
pub(super) fn sample_after_training(
    pipe: &mut Pipeline,
    args: &TransformerArgs,
    data: &TextDataset,
    val: &TextDataset,
) -> AppResult<String> {
    let p = &args.pipe;
    let prompt_text = if args.data.is_none() {
        "the ".to_string()
    } else {
        val.decode(&val.tokens()[..8.min(val.len())])
    };
    let prompt = data.encode(&prompt_text).unwrap_or_else(|_| vec![0]);
    let sample = sample_text(
        pipe,
        data,
        &prompt,
        args.seq_len,
        args.sample_len,
        args.temperature,
        p.seed,
    )?;
    crate::say!(
        "\nsample (temperature {}):\n{}\n",
        args.temperature,
        sample.trim_end()
    );
    Ok(sample)
}

/// Samples `len` tokens after `prompt` for `rows` sequences at once (the pipeline splits its
/// input into M micro-batches, so it needs at least M rows). Returns the first row's text.
/// Each token is a forward-only round (`Pipeline::predict`): the last stage keeps the logits
/// of the last position and hands them to every rank, which all draw the same token from the
/// same generator, so no rank needs the whole model.
fn sample_text(
    pipe: &mut Pipeline,
    data: &TextDataset,
    prompt: &[u32],
    seq_len: usize,
    len: usize,
    temperature: f32,
    seed: u64,
) -> AppResult<String> {
    let rows = pipe.num_micro_batches();
    let mut seqs: Vec<Vec<u32>> = vec![prompt.to_vec(); rows];
    let mut rng = SplitMix64::new(seed ^ 0x5EED);
    let v = data.vocab_size();
    for _ in 0..len {
        let t = seqs[0].len().min(seq_len);
        let ids: Vec<u32> = seqs
            .iter()
            .flat_map(|s| s[s.len() - t..].iter().copied())
            .collect();
        let last = pipe
            .predict(&ids_tensor(&ids, &[rows, t])?, &move |logits| {
                logits.narrow(1, t - 1, 1)
            })?
            .to_vec()?;
        for (r, s) in seqs.iter_mut().enumerate() {
            let row = &last[r * v..(r + 1) * v];
            s.push(pick(row, temperature, &mut rng));
        }
    }
    Ok(data.decode(&seqs[0]))
}

/// Greedy (temperature 0) or softmax(logits / temperature) sampling.
fn pick(logits: &[f32], temperature: f32, rng: &mut SplitMix64) -> u32 {
    let argmax = logits
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i);
    if temperature <= 0.0 {
        return argmax as u32;
    }
    let m = logits[argmax];
    let w: Vec<f64> = logits
        .iter()
        .map(|&l| (((l - m) / temperature) as f64).exp())
        .collect();
    let mut u = rng.unit() * w.iter().sum::<f64>();
    for (i, wi) in w.iter().enumerate() {
        u -= wi;
        if u <= 0.0 {
            return i as u32;
        }
    }
    argmax as u32
}
