//! A GPT-style language model as a layer sequence:
//! `[TokenPositionEmbedding, TransformerBlock x layers, LayerNorm, Linear head]`.
//! Input: token ids `[B, T]` (f32 values holding integers, `T <= seq_len`);
//! output: logits `[B, T, vocab]`. Each block is one element, so a pipeline can cut anywhere.
//!
//! With `tie_embeddings` (GPT-2's choice) the head has no bias and its weight is the token
//! embedding table (initialised N(0, 1/d_model) then, the positions alike): a tied copy ([`wgpipe_autograd::tied`]), so that the two can sit on different
//! pipeline stages; their gradients are summed before each optimizer step.

use wgpipe_autograd::Module;
use wgpipe_tensor::{Device, Error, Result};

use crate::init::sub_seed;
use crate::layers::{LayerNorm, Linear, TokenPositionEmbedding, TransformerBlock};

#[derive(Debug, Clone, PartialEq)]
pub struct TransformerLm {
    pub vocab: usize,
    pub d_model: usize,
    pub heads: usize,
    pub layers: usize,
    /// The longest sequence (size of the positional table).
    pub seq_len: usize,
    /// Dropout after the embedding, on attention probabilities and on each residual branch.
    pub dropout: f32,
    /// The head's weight is the token embedding table (tied copies, no head bias).
    pub tie_embeddings: bool,
}

/// The tie group of the token embedding table and the head's weight.
pub const EMBEDDING_TIE: &str = "token_embedding";

impl TransformerLm {
    /// `layers + 3` elements; element `i` is initialised from `sub_seed(seed, i)`.
    pub fn build(&self, seed: u64, dev: &Device) -> Result<Vec<Box<dyn Module>>> {
        if self.vocab == 0 || self.d_model == 0 || self.seq_len == 0 {
            return Err(Error::Invalid {
                op: "TransformerLm",
                msg: format!("vocab, d_model and seq_len must be positive: {self:?}"),
            });
        }
        let mut v: Vec<Box<dyn Module>> = Vec::with_capacity(self.layers + 3);
        let embedding = TokenPositionEmbedding::new(
            self.vocab,
            self.seq_len,
            self.d_model,
            self.dropout,
            sub_seed(seed, 0),
            dev,
        )?;
        let head = if self.tie_embeddings {
            // As the head's weight the table must give logits of unit scale from the
            // layer-normed features: entries N(0, 1/d_model) rather than N(0, 1); the
            // positional table is scaled alike so tokens and positions keep their balance.
            let scale = (self.d_model as f32).powf(-0.5);
            for table in [&embedding.tok.weight, &embedding.pos.weight] {
                table.set_value(table.value().mul_scalar(scale)?);
            }
            let table = &embedding.tok.weight;
            // `[vocab, d_model]` is both the table and the head's `[out, in]` weight.
            let w = table.tied_copy("weight", EMBEDDING_TIE)?;
            Linear::from_params(w, None)?
        } else {
            Linear::new(
                self.d_model,
                self.vocab,
                sub_seed(seed, 2 + self.layers as u64),
                dev,
            )?
        };
        v.push(Box::new(embedding));
        for l in 0..self.layers {
            v.push(Box::new(TransformerBlock::new(
                self.d_model,
                self.heads,
                self.dropout,
                sub_seed(seed, 1 + l as u64),
                dev,
            )?));
        }
        v.push(Box::new(LayerNorm::new(self.d_model, dev)?));
        v.push(Box::new(head));
        Ok(v)
    }
}
