//! A layer's cost measured by running it once: the default of [`Module::cost`], so a layer
//! written by a user needs no hand-computed FLOPs, output shape or activation bytes.

use wgpipe_tensor::{thread_flops, thread_net_bytes, Device, Result, Tensor};

use super::{CostHint, ForwardCtx, Module};
use crate::tape::Tape;

/// What one forward of `layer` on an input of `input_shape` costs, measured on a run on zeros
/// of that shape, recorded as a training forward records (on a recompute tape with a recompute
/// context, so layers with side effects, like batch-norm statistics, skip them):
///
/// - `output_shape`: the output's shape;
/// - `flops`: the FLOPs the run's ops counted (each op's
///   front-end counts its own, e.g. `2 m k n` for a matmul);
/// - `activation_bytes`: the bytes still held by the tape after the input and
///   output handles are dropped: what the forward keeps for its backward;
/// - `param_bytes`: the parameters' bytes.
///
/// The run happens on the device of the layer's first parameter (the CPU when it has none) and
/// is counted by this thread's counters (`wgpipe_tensor::thread_flops`, `thread_net_bytes`),
/// so other threads' work on that device does not enter it. A layer that fails on zeros (an
/// input that must hold valid indices past 0, say) gets a pass-through estimate, with the
/// error on stderr; such a layer should implement [`Module::cost`] itself.
pub fn measured_cost<M: Module + ?Sized>(layer: &M, input_shape: &[usize]) -> CostHint {
    let params = layer.parameters();
    let param_bytes = params
        .iter()
        .map(|(_, p)| {
            let v = p.value();
            v.numel() * v.dtype().size_of()
        })
        .sum();
    let device = params
        .first()
        .map(|(_, p)| p.device())
        .unwrap_or_else(Device::cpu);
    match run_once(layer, input_shape, &device) {
        Ok((output_shape, flops, activation_bytes)) => CostHint {
            param_bytes,
            flops,
            activation_bytes,
            output_shape,
        },
        Err(e) => {
            eprintln!(
                "wgpipe: the cost of {} for input {input_shape:?} could not be measured ({e}); \
                 counted as a pass-through (implement Module::cost for it)",
                layer.name()
            );
            CostHint {
                param_bytes,
                ..CostHint::pass_through(input_shape)
            }
        }
    }
}

/// The output shape, forward FLOPs and bytes kept by the tape of one recorded run, counted on
/// this thread (other threads may work on the same device meanwhile).
fn run_once<M: Module + ?Sized>(
    layer: &M,
    input_shape: &[usize],
    device: &Device,
) -> Result<(Vec<usize>, f64, usize)> {
    let bytes_before = thread_net_bytes();
    let tape = Tape::recompute();
    let x = tape.leaf(Tensor::zeros(input_shape, device)?);
    let ctx = ForwardCtx {
        recompute: true,
        ..ForwardCtx::train(0, 0, 0)
    };
    let flops_before = thread_flops();
    let y = layer.forward(&x, &ctx)?;
    let flops = thread_flops().wrapping_sub(flops_before) as f64;
    let output_shape = y.shape().to_vec();
    drop((x, y));
    let kept = thread_net_bytes().wrapping_sub(bytes_before).max(0) as usize;
    drop(tape);
    Ok((output_shape, flops, kept))
}

/// `a::b::Name<c::D>` as `Name`: a type's name for reports.
pub(crate) fn short_type_name(full: &str) -> String {
    let base = full.split('<').next().unwrap_or(full);
    base.rsplit("::").next().unwrap_or(base).to_string()
}

#[cfg(test)]
mod tests {
    use super::short_type_name;

    #[test]
    fn short_type_names_drop_paths_and_generics() {
        assert_eq!(short_type_name("my_crate::layers::Gate"), "Gate");
        assert_eq!(short_type_name("a::Wrap<b::Inner, c::D>"), "Wrap");
        assert_eq!(short_type_name("Plain"), "Plain");
    }
}
