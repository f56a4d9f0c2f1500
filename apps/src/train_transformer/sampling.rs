//! Text from the trained model (through [`crate::generate`]), after a prompt.

use super::TransformerArgs;
use crate::error::AppResult;
use crate::generate::{generate, Sampling};
use crate::models::data::TextDataset;
use crate::pipeline::Pipeline;

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

/// Samples `len` tokens after `prompt` for the pipeline's M rows at once (see
/// [`crate::generate::generate`]); returns the first row's text, prompt included.
fn sample_text(
    pipe: &mut Pipeline,
    data: &TextDataset,
    prompt: &[u32],
    seq_len: usize,
    len: usize,
    temperature: f32,
    seed: u64,
) -> AppResult<String> {
    let sampling = Sampling {
        temperature,
        top_k: 0,
        top_p: 1.0,
        seed,
        // The main job's attention keeps no cache: each token runs the window again.
        kv_cache: false,
    };
    let rows = pipe.num_micro_batches();
    let new = generate(
        pipe,
        rows,
        prompt,
        len,
        seq_len,
        data.vocab_size(),
        &sampling,
    )?;
    Ok(data.decode(&[prompt, &new].concat()))
}
