//! Whole models as layer sequences (`Vec<Box<dyn Module>>`), ready to run plainly with
//! [`forward_all`](crate::forward_all) or to be cut into pipeline stages anywhere.

pub mod amoebanet;
pub mod gpt2;
pub mod llama;
pub mod llama_config;
pub mod resnet;
pub mod resnetv2;
pub mod transformer_lm;

pub use amoebanet::AmoebaNet;
pub use gpt2::{Gpt2, Gpt2Config, GPT2_EMBEDDING_TIE};
pub use llama::{Llama, LlamaDecoderLayer, LlamaLayerConfig, LLAMA_EMBEDDING_TIE};
pub use llama_config::LlamaConfig;
pub use resnet::ResNet;
pub use resnetv2::ResNetV2;
pub use transformer_lm::TransformerLm;

use std::ops::Range;
use std::sync::Arc;

use wgpipe_autograd::{ModelFactory, Module};
use wgpipe_tensor::{Device, Error, Result};

use crate::layers::Linear;

/// How a model's parameters lie in its Hugging Face checkpoint (what the `hf` module reads and
/// writes them by).
pub trait HfNames: BuildsRanges {
    /// The checkpoint key of parameter `name` of layer `layer`, and whether the checkpoint
    /// stores that matrix transposed (`[in, out]`, as GPT-2's Conv1D does). A tied head gives
    /// the key of the table it copies.
    fn checkpoint_key(&self, layer: usize, name: &str) -> (String, bool);
    /// Whether a checkpoint tensor that no parameter reads may be there anyway (GPT-2's
    /// attention-mask buffers); any other is refused when the whole model is loaded.
    fn ignorable(&self, _key: &str) -> bool {
        false
    }
    /// Whether layer `layer`'s parameter `name` is a copy of a tensor an earlier layer also
    /// holds (a tied head: the checkpoint stores the table once, under the table's key), so that
    /// a writer of one stage's tensors leaves it to the stage holding the table.
    fn is_tied_copy(&self, _layer: usize, _name: &str) -> bool {
        false
    }
}

/// A model description whose layers can be built by range, each from the seed and its own
/// index alone (so any cut, built in any order, gives the whole model's values).
pub trait BuildsRanges: Clone + Send + Sync + 'static {
    /// The number of layers of the whole model.
    fn num_layers(&self) -> usize;
    /// Layers `range` of the model from `seed`, on `dev`.
    fn build_range(
        &self,
        seed: u64,
        range: Range<usize>,
        dev: &Device,
    ) -> Result<Vec<Box<dyn Module>>>;
}

/// A [`ModelFactory`] of `config` from `seed` on `dev`: what a pipeline builds only the layers
/// it holds from (`Pipeline::builder_from`).
pub fn factory<M: BuildsRanges>(config: &M, seed: u64, dev: &Device) -> Arc<dyn ModelFactory> {
    Arc::new(RangeFactory {
        config: config.clone(),
        seed,
        device: dev.clone(),
    })
}

/// [`factory`].
struct RangeFactory<M> {
    config: M,
    seed: u64,
    device: Device,
}

impl<M: BuildsRanges> ModelFactory for RangeFactory<M> {
    fn num_layers(&self) -> usize {
        self.config.num_layers()
    }
    fn build_range(&self, range: Range<usize>) -> Result<Vec<Box<dyn Module>>> {
        self.config.build_range(self.seed, range, &self.device)
    }
    /// Without drawing values: every rank describes every layer of the model.
    fn describe_range(&self, range: Range<usize>) -> Result<Vec<Box<dyn Module>>> {
        crate::init::without_random_init(|| self.config.build_range(self.seed, range, &self.device))
    }
}

/// The error for `range` outside a model of `n` layers (`op` names the model).
fn check_range(op: &'static str, range: &Range<usize>, n: usize) -> Result<()> {
    if range.start > range.end || range.end > n {
        return Err(Error::Invalid {
            op,
            msg: format!("layers {range:?} of a model of {n} layers"),
        });
    }
    Ok(())
}

/// Replaces the classifier head (the last element, a `Linear` with a `weight [classes, in]`)
/// by a freshly initialised `Linear(in, num_classes)` (transfer learning: keep the body,
/// train a new head).
pub fn replace_head(
    layers: &mut Vec<Box<dyn Module>>,
    num_classes: usize,
    seed: u64,
    dev: &Device,
) -> Result<()> {
    let invalid = |msg: String| Error::Invalid {
        op: "replace_head",
        msg,
    };
    let last = layers
        .last()
        .ok_or_else(|| invalid("the model has no layers".into()))?;
    let w = last
        .parameters()
        .into_iter()
        .find(|(n, _)| n == "weight")
        .map(|(_, p)| p.shape())
        .ok_or_else(|| {
            invalid(format!(
                "the last layer ({}) has no `weight`: it is not a linear classifier head",
                last.name()
            ))
        })?;
    if w.len() != 2 {
        return Err(invalid(format!(
            "the last layer's weight is {w:?}, not a linear head's [classes, in]"
        )));
    }
    let head = Linear::new(w[1], num_classes, seed, dev)?;
    *layers.last_mut().expect("checked above") = Box::new(head);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use wgpipe_autograd::layer_param_name;

    /// Every parameter and buffer of `layers` (the first at global index `first`) by global
    /// name, as bits, with the layer's name.
    fn bits(first: usize, layers: &[Box<dyn Module>]) -> Vec<(String, String, Vec<u32>)> {
        let mut out = Vec::new();
        for (i, l) in layers.iter().enumerate() {
            for (n, p) in l.parameters().into_iter().chain(l.buffers()) {
                let v = p.value().to_vec().unwrap();
                out.push((
                    layer_param_name(first + i, &n),
                    l.name(),
                    v.iter().map(|x| x.to_bits()).collect(),
                ));
            }
        }
        out.sort();
        out
    }

    /// Cuts of `model` into pieces, built last piece first, give the whole model's layers
    /// and values bit for bit.
    fn ranges_give_the_whole<M: BuildsRanges>(model: &M) {
        let cpu = Device::cpu();
        let n = model.num_layers();
        let whole = model.build_range(5, 0..n, &cpu).unwrap();
        assert_eq!(whole.len(), n);
        let whole = bits(0, &whole);
        for cuts in [vec![1], vec![2, n - 2], vec![1, 3, n - 1], (1..n).collect()] {
            let mut bounds = vec![0];
            bounds.extend(cuts.iter().copied().filter(|&c| c > 0 && c < n));
            bounds.push(n);
            let mut got = Vec::new();
            for w in bounds.windows(2).rev() {
                let piece = model.build_range(5, w[0]..w[1], &cpu).unwrap();
                assert_eq!(piece.len(), w[1] - w[0], "cuts {cuts:?}");
                got.extend(bits(w[0], &piece));
            }
            got.sort();
            assert_eq!(got, whole, "cuts {cuts:?}");
        }
        let Err(err) = model.build_range(5, 1..n + 1, &cpu) else {
            panic!("layers 1..{} of {n} were built", n + 1);
        };
        let err = err.to_string();
        assert!(err.contains(&format!("of a model of {n} layers")), "{err}");
    }

    #[test]
    fn cnn_ranges_built_in_any_order_give_the_whole_models_values() {
        ranges_give_the_whole(&ResNet {
            blocks: vec![2, 1, 1],
            width: 4,
            num_classes: 3,
            in_channels: 2,
        });
        ranges_give_the_whole(&AmoebaNet {
            normal_cells: 1,
            filters: 4,
            num_classes: 3,
            in_channels: 2,
        });
    }
}
