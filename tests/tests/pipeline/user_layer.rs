//! A layer written the way a user of the library writes one (issue 56): one forward function
//! (an inherent method), its parameters declared once, as fields, by `#[derive(Module)]`, its
//! weights read with `x.param(..)` and its cost left to the default (measured by a run). It
//! must train through a two-stage pipeline in f32, f16 and bf16 with nothing more.

use wgpipe_autograd::{measured_cost, ForwardCtx, Module, Param, Var};
use wgpipe_models::{forward_all, Linear};
use wgpipe_pipeline::{CheckpointMode, ScheduleKind};
use wgpipe_tensor::{DType, Device, Result, Tensor};
use wgpipe_tests::*;

const WIDTH: usize = 8;

/// `x + proj(sigmoid(x Wg^T) * tanh(x W^T + b))`: a gated residual unit with a built-in child
/// (`Linear`) saved under the name `proj`.
#[derive(Module)]
struct GatedUnit {
    gate: Param,
    weight: Param,
    bias: Option<Param>,
    #[wgpipe(module, rename = "proj")]
    out: Linear,
}

impl GatedUnit {
    fn new(seed: u64) -> GatedUnit {
        let d = Device::cpu();
        let b = 1.0 / (WIDTH as f32).sqrt();
        let uniform = |shape: &[usize], s: u64| Tensor::rand_uniform(shape, -b, b, s, &d).unwrap();
        GatedUnit {
            gate: Param::new("gate", uniform(&[WIDTH, WIDTH], seed)),
            weight: Param::new("weight", uniform(&[WIDTH, WIDTH], seed + 1)),
            bias: Some(Param::new("bias", uniform(&[WIDTH], seed + 2))),
            out: Linear::new(WIDTH, WIDTH, seed + 3, &d).unwrap(),
        }
    }

    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let g = x.matmul(&x.param(&self.gate)?.t()?)?.sigmoid()?;
        let mut h = x.matmul(&x.param(&self.weight)?.t()?)?;
        if let Some(b) = &self.bias {
            h = h.add(&x.param(b)?)?;
        }
        x.add(&self.out.forward(&g.mul(&h.tanh()?)?, ctx)?)
    }
}

/// A built-in Linear first (it casts the data to the compute dtype, as a model's first layer
/// does), then three user units, the last two on the second stage.
fn model() -> Vec<Box<dyn Module>> {
    let d = Device::cpu();
    let mut layers: Vec<Box<dyn Module>> =
        vec![Box::new(Linear::new(WIDTH, WIDTH, 7, &d).unwrap())];
    for i in 0..3 {
        layers.push(Box::new(GatedUnit::new(100 + 10 * i)));
    }
    layers
}

fn mse_f32(y: &Var, t: &Tensor) -> Result<Var> {
    mse(&y.to_dtype(DType::F32)?, t)
}

#[test]
fn a_derived_layer_names_its_fields_and_measures_its_cost() {
    let unit = GatedUnit::new(1);
    assert_eq!(unit.name(), "GatedUnit");
    let names: Vec<String> = unit.parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        ["gate", "weight", "bias", "proj.weight", "proj.bias"]
    );
    // The default cost runs the unit once on [4, WIDTH] and counts what its ops count: three
    // products of 2*4*8*8 FLOPs and six elementwise ops (sigmoid, bias, tanh, gating, the
    // projection's bias, the residual) of one FLOP a value. The tape keeps the input (for the
    // products' weight gradients), the gate and the tanh (each other's gradients) and the
    // projection's input: four [4, WIDTH] f32 tensors.
    let c = unit.cost(&[4, WIDTH]);
    assert_eq!(c.output_shape, [4, WIDTH]);
    assert_eq!(c.param_bytes, 4 * (3 * WIDTH * WIDTH + 2 * WIDTH));
    assert_eq!(
        c.flops,
        (3 * 2 * 4 * WIDTH * WIDTH + 6 * 4 * WIDTH) as f64,
        "{c:?}"
    );
    assert_eq!(c.activation_bytes, 4 * (4 * 4 * WIDTH), "{c:?}");
}

/// The measured cost against a built-in layer's hand-written one, an independent formula.
#[test]
fn the_measured_cost_of_a_linear_is_its_hand_written_cost() {
    let d = Device::cpu();
    for (shape, act) in [
        ([4, WIDTH], None),
        ([3, WIDTH], Some(wgpipe_tensor::UnaryOp::Relu)),
    ] {
        let mut linear = Linear::new(WIDTH, 5, 9, &d).unwrap();
        if let Some(act) = act {
            linear = linear.with_activation(act).unwrap();
        }
        assert_eq!(
            measured_cost(&linear, &shape),
            linear.cost(&shape),
            "{act:?}"
        );
    }
}

#[test]
fn a_derived_layer_computes_in_the_half_stream() {
    for dtype in [DType::F16, DType::BF16] {
        let layers = model();
        let tape = wgpipe_autograd::Tape::new();
        let x = tape.leaf(normal_data(&[4, WIDTH], 3));
        let y = forward_all(&layers, &x, &ForwardCtx::eval().with_compute(dtype)).unwrap();
        assert_eq!(
            y.value().dtype(),
            dtype,
            "the units' output is in {dtype:?}"
        );
        let loss = mse_f32(&y, &normal_data(&[4, WIDTH], 4)).unwrap();
        tape.backward(&loss).unwrap();
        for (name, p) in wgpipe_models::sequence_parameters(&layers) {
            let g = p
                .grad()
                .unwrap_or_else(|| panic!("{dtype:?}: {name} got no gradient"));
            assert_eq!(g.dtype(), DType::F32, "{name}: the f32 master's gradient");
        }
    }
}

/// Through K=2 (GPipe, re-materializing all but the last micro-batch) in f32, f16 and bf16:
/// the half runs train (the loss falls), end within half precision's rounding of the f32 run,
/// and name the units' parameters by their fields.
#[test]
fn a_derived_layer_trains_through_two_stages_in_f32_f16_and_bf16() {
    let (x, y) = (normal_data(&[8, WIDTH], 1), normal_data(&[8, WIDTH], 2));
    let run = |precision: DType| {
        let cfg = PipeCfg {
            precision,
            balance: Some(vec![2, 2]),
            ..PipeCfg::new(2, 4, CheckpointMode::ExceptLast, ScheduleKind::GPipe)
        };
        let mut pipe = sim_pipeline(model(), &cfg);
        pipe_train(&mut pipe, &x, &y, &mse_f32, 6).0
    };
    let full = run(DType::F32);
    let names: Vec<&str> = full.params.iter().map(|(n, _)| n.as_str()).collect();
    for name in ["1.gate", "1.bias", "2.proj.weight", "3.weight"] {
        assert!(names.contains(&name), "{name} in {names:?}");
    }
    for (precision, tol) in [(DType::F16, 2e-3), (DType::BF16, 1.5e-2)] {
        let half = run(precision);
        assert!(
            half.losses.last() < half.losses.first(),
            "{precision:?}: {:?}",
            half.losses
        );
        let (e, at) = worst_err(&half, &full);
        assert!(e <= tol, "{precision:?}: {e:.2e} at {at}, past {tol:.0e}");
        eprintln!("{precision:?} vs f32 after 6 steps: worst {e:.2e} at {at}");
    }
}
