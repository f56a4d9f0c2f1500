//! A GPT-style language model as a layer sequence:
//! `[TokenPositionEmbedding, TransformerBlock x layers, LayerNorm, Linear head]`.
//! Input: token ids `[B, T]` (f32 values holding integers, `T <= seq_len`);
//! output: logits `[B, T, vocab]`. Each block is one element, so a pipeline can cut anywhere.
//!
//! With `tie_embeddings` (GPT-2's choice) the head has no bias and its weight is the token
//! embedding table (initialised N(0, 1/d_model) then, the positions alike): a tied copy ([`wgpipe_autograd::tied`]), so that the two can sit on different
//! pipeline stages; their gradients are summed before each optimizer step.

use std::ops::Range;
use std::sync::Arc;

use wgpipe_autograd::{ModelFactory, Module};
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
    /// The number of elements: `layers + 3` (embedding, blocks, final norm, head).
    pub fn num_layers(&self) -> usize {
        self.layers + 3
    }

    /// The number of parameters of the model, a tied table counted once (what
    /// `parameter_count` gives of the built layers), known without building it: the
    /// embedding's two tables, per block two layer norms (2d each), the attention's four
    /// projections (4d^2 + 4d) and the MLP (d x 4d + 4d, 4d x d + d), the final norm, and the
    /// untied head's weight and bias.
    pub fn parameter_count(&self) -> usize {
        let (v, d, t) = (self.vocab, self.d_model, self.seq_len);
        let block = 12 * d * d + 13 * d;
        let head = if self.tie_embeddings { 0 } else { d * v + v };
        v * d + t * d + self.layers * block + 2 * d + head
    }

    /// `layers + 3` elements; element `i` is initialised from `sub_seed(seed, i)` (the untied
    /// head from `sub_seed(seed, layers + 2)`, the tied one from the embedding's table).
    pub fn build(&self, seed: u64, dev: &Device) -> Result<Vec<Box<dyn Module>>> {
        self.build_range(seed, 0..self.num_layers(), dev)
    }

    /// Elements `range` of the model alone, with the values [`TransformerLm::build`] gives
    /// them: each element's from the seed and its index only. A tied head built without the
    /// embedding takes its weight from an embedding table built for the purpose and dropped
    /// (the table is `vocab x d_model`, small beside the blocks).
    pub fn build_range(
        &self,
        seed: u64,
        range: Range<usize>,
        dev: &Device,
    ) -> Result<Vec<Box<dyn Module>>> {
        if self.vocab == 0 || self.d_model == 0 || self.seq_len == 0 {
            return Err(Error::Invalid {
                op: "TransformerLm",
                msg: format!("vocab, d_model and seq_len must be positive: {self:?}"),
            });
        }
        let n = self.num_layers();
        super::check_range("TransformerLm", &range, n)?;
        let head_index = n - 1;
        let mut v: Vec<Box<dyn Module>> = Vec::with_capacity(range.len());
        for i in range {
            let layer: Box<dyn Module> = if i == 0 {
                Box::new(self.embedding(seed, dev)?)
            } else if i < head_index - 1 {
                Box::new(TransformerBlock::new(
                    self.d_model,
                    self.heads,
                    self.dropout,
                    sub_seed(seed, i as u64),
                    dev,
                )?)
            } else if i == head_index - 1 {
                Box::new(LayerNorm::new(self.d_model, dev)?)
            } else if self.tie_embeddings {
                // `[vocab, d_model]` is both the table and the head's `[out, in]` weight.
                let table = &self.embedding(seed, dev)?.tok.weight;
                let w = table.tied_copy("weight", EMBEDDING_TIE)?;
                Box::new(Linear::from_params(w, None)?)
            } else {
                Box::new(Linear::new(
                    self.d_model,
                    self.vocab,
                    sub_seed(seed, i as u64),
                    dev,
                )?)
            };
            v.push(layer);
        }
        Ok(v)
    }

    /// Element 0: the token and position tables, from `sub_seed(seed, 0)`; tied to the head,
    /// scaled and in the tie group whether or not the head is built beside it.
    fn embedding(&self, seed: u64, dev: &Device) -> Result<TokenPositionEmbedding> {
        let embedding = TokenPositionEmbedding::new(
            self.vocab,
            self.seq_len,
            self.d_model,
            self.dropout,
            sub_seed(seed, 0),
            dev,
        )?;
        if self.tie_embeddings {
            // As the head's weight the table must give logits of unit scale from the
            // layer-normed features: entries N(0, 1/d_model) rather than N(0, 1); the
            // positional table is scaled alike so tokens and positions keep their balance.
            let scale = (self.d_model as f32).powf(-0.5);
            for table in [&embedding.tok.weight, &embedding.pos.weight] {
                table.set_value(table.value().mul_scalar(scale)?);
            }
            embedding.tok.weight.set_tie_group(EMBEDDING_TIE);
        }
        Ok(embedding)
    }

    /// A [`ModelFactory`] of this model from `seed` on `dev`: what a pipeline builds only the
    /// layers it holds from (`Pipeline::builder_from`).
    pub fn factory(&self, seed: u64, dev: &Device) -> Arc<dyn ModelFactory> {
        super::factory(self, seed, dev)
    }
}

impl super::BuildsRanges for TransformerLm {
    fn num_layers(&self) -> usize {
        TransformerLm::num_layers(self)
    }
    fn build_range(
        &self,
        seed: u64,
        range: Range<usize>,
        dev: &Device,
    ) -> Result<Vec<Box<dyn Module>>> {
        TransformerLm::build_range(self, seed, range, dev)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wgpipe_autograd::layer_param_name;

    /// Every parameter of `layers` (the first at global index `first`) by global name, as bits,
    /// with its tie group.
    fn bits(first: usize, layers: &[Box<dyn Module>]) -> Vec<(String, Vec<u32>, Option<String>)> {
        let mut out = Vec::new();
        for (i, l) in layers.iter().enumerate() {
            for (n, p) in l.parameters() {
                let v = p.value().to_vec().unwrap();
                out.push((
                    layer_param_name(first + i, &n),
                    v.iter().map(|x| x.to_bits()).collect(),
                    p.tie_group(),
                ));
            }
        }
        out
    }

    /// Any cut of the model, its pieces built in any order, gives the whole model's
    /// parameters bit for bit (tie groups included), tied or not.
    #[test]
    fn ranges_built_in_any_order_give_the_whole_models_values() {
        let cpu = Device::cpu();
        for tie in [true, false] {
            let cfg = TransformerLm {
                vocab: 11,
                d_model: 8,
                heads: 2,
                layers: 4,
                seq_len: 5,
                dropout: 0.1,
                tie_embeddings: tie,
            };
            let whole = bits(0, &cfg.build(7, &cpu).unwrap());
            for cuts in [
                vec![0, 7],
                vec![0, 1, 7],
                vec![0, 3, 5, 6, 7],
                vec![0, 6, 7],
            ] {
                let mut pieces: Vec<_> = cuts.windows(2).map(|w| w[0]..w[1]).collect();
                pieces.reverse();
                let mut got = Vec::new();
                for r in pieces {
                    got.extend(bits(r.start, &cfg.build_range(7, r, &cpu).unwrap()));
                }
                got.sort();
                let mut want = whole.clone();
                want.sort();
                assert_eq!(got, want, "tie {tie}, cuts {cuts:?}");
            }
        }
    }

    #[test]
    fn parameter_count_is_the_built_models() {
        let cpu = Device::cpu();
        for tie in [true, false] {
            let cfg = TransformerLm {
                vocab: 13,
                d_model: 12,
                heads: 3,
                layers: 3,
                seq_len: 9,
                dropout: 0.0,
                tie_embeddings: tie,
            };
            let layers = cfg.build(1, &cpu).unwrap();
            assert_eq!(
                cfg.parameter_count(),
                crate::parameter_count(&layers),
                "tie {tie}"
            );
        }
    }

    #[test]
    fn a_range_past_the_model_is_refused_naming_it() {
        let cfg = TransformerLm {
            vocab: 5,
            d_model: 4,
            heads: 1,
            layers: 1,
            seq_len: 3,
            dropout: 0.0,
            tie_embeddings: true,
        };
        let e = cfg.build_range(0, 2..5, &Device::cpu()).err().unwrap();
        assert!(e.to_string().contains("2..5"), "{e}");
        assert!(e.to_string().contains("4 layers"), "{e}");
    }
}
