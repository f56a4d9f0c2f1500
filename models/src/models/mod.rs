//! Whole models as layer sequences (`Vec<Box<dyn Module>>`), ready to run plainly with
//! [`forward_all`](crate::forward_all) or to be cut into pipeline stages anywhere.

pub mod amoebanet;
pub mod resnet;
pub mod transformer_lm;

pub use amoebanet::AmoebaNet;
pub use resnet::ResNet;
pub use transformer_lm::TransformerLm;

use wgpipe_autograd::Module;
use wgpipe_tensor::{Device, Error, Result};

use crate::layers::Linear;

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
