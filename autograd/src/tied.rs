//! Tied parameters: one parameter used in several places (a language model's input embedding
//! and output head), held as copies that share a tie group ([`Param::tied_copy`]), so that each
//! copy can live on the device of the layer that uses it. Their gradients are summed before the
//! optimizer step and the sum given to every copy: the same update then keeps the copies
//! bit-identical, and equals training one shared parameter.

use wgpipe_tensor::{Error, Result};

use crate::param::Param;

/// The tie groups among `params` with at least two copies: (group, indices into `params` in
/// order), groups in order of first appearance.
pub fn tied_groups(params: &[(String, Param)]) -> Vec<(String, Vec<usize>)> {
    let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
    for (i, (_, p)) in params.iter().enumerate() {
        let Some(g) = p.tie_group() else { continue };
        match groups.iter_mut().find(|(n, _)| *n == g) {
            Some((_, v)) => v.push(i),
            None => groups.push((g, vec![i])),
        }
    }
    groups.retain(|(_, v)| v.len() > 1);
    groups
}

/// Sums the gradients of every tie group's copies, in the order of `params` and on the first
/// copy's device, and gives every copy the sum (on its own device). A copy without a gradient
/// adds nothing. Returns the bytes each group's sum holds (what each copy sends and receives).
pub fn sum_tied_grads(params: &[(String, Param)]) -> Result<Vec<(String, usize)>> {
    let mut moved = Vec::new();
    for (group, idx) in tied_groups(params) {
        let first = &params[idx[0]].1;
        let device = first.device();
        let mut sum: Option<wgpipe_tensor::Tensor> = None;
        for &i in &idx {
            if let Some(g) = params[i].1.grad() {
                let g = g.to_device(&device)?;
                sum = Some(match sum {
                    Some(s) => s.add(&g)?,
                    None => g,
                });
            }
        }
        let Some(sum) = sum else { continue };
        for &i in &idx {
            let p = &params[i].1;
            p.set_grad(Some(sum.to_device(&p.device())?));
        }
        moved.push((group, sum.numel() * std::mem::size_of::<f32>()));
    }
    Ok(moved)
}

/// Checks that every tie group's copies have one shape and bit-identical values; the error
/// names the two copies that differ.
pub fn check_tied(params: &[(String, Param)]) -> Result<()> {
    for (group, idx) in tied_groups(params) {
        let (first_name, first) = &params[idx[0]];
        let want = first.value().to_vec()?;
        for &i in &idx[1..] {
            let (name, p) = &params[i];
            if p.shape() != first.shape() || p.value().to_vec()? != want {
                return Err(Error::Invalid {
                    op: "tied parameters",
                    msg: format!(
                        "{name} ({:?}) and {first_name} ({:?}) are tied in group '{group}' but \
                         differ",
                        p.shape(),
                        first.shape()
                    ),
                });
            }
        }
    }
    Ok(())
}
