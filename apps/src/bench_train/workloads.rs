//! The workloads (layers, batch, loss and optimizer of each) and wgpipe's training steps on
//! them, timed plainly and through a 1-stage pipeline.

use std::time::Instant;

use super::{median, BenchArgs, Workload};
use crate::autograd::optim::{zero_grad, Optimizer};
use crate::autograd::{AdamW, ForwardCtx, Module, Sgd, Tape, Var};
use crate::error::AppResult;
use crate::models::{
    cross_entropy, finish_step_all, forward_all, mse, sequence_parameters, Gelu, Linear,
    TransformerBlock, TransformerLm,
};
use crate::pipeline::{CheckpointMode, Pipeline};
use crate::prim_block::PrimitiveBlock;
use crate::tensor::{take_cpu_matmul_times, time_cpu_matmuls, Device, MatmulTime, Tensor, UnaryOp};

/// A workload's layers, inputs and targets (deterministic).
pub struct Work {
    pub layers: Vec<Box<dyn Module>>,
    pub x: Tensor,
    pub y: Tensor,
}

/// The layers and the batch of workload `w` on `dev` (the same for every bench that times it).
pub fn workload(w: Workload, dev: &Device) -> AppResult<Work> {
    Ok(match w {
        Workload::Mlp => {
            let mut layers: Vec<Box<dyn Module>> = Vec::new();
            for i in 0..4 {
                let linear = Linear::new(1024, 1024, i, dev)?;
                layers.push(Box::new(if i < 3 {
                    linear.with_activation(UnaryOp::Relu)?
                } else {
                    linear
                }));
            }
            let x = Tensor::rand_normal(&[256, 1024], 0.0, 1.0, 1, dev)?;
            let y = Tensor::rand_normal(&[256, 1024], 0.0, 1.0, 2, dev)?;
            Work { layers, x, y }
        }
        Workload::Block => {
            // q, k and v in one projection, as the PyTorch reference's block.
            let block = TransformerBlock::new(256, 4, 0.0, 3, dev)?
                .with_gelu(Gelu::Exact)
                .with_packed_qkv()?;
            let layers: Vec<Box<dyn Module>> = vec![Box::new(block)];
            let x = Tensor::rand_normal(&[8, 128, 256], 0.0, 1.0, 4, dev)?;
            let y = Tensor::rand_normal(&[8, 128, 256], 0.0, 1.0, 5, dev)?;
            Work { layers, x, y }
        }
        Workload::Prim => {
            let layers: Vec<Box<dyn Module>> =
                vec![Box::new(PrimitiveBlock::new(256, 4, 128, 3, dev)?)];
            let x = Tensor::rand_normal(&[8, 128, 256], 0.0, 1.0, 4, dev)?;
            let y = Tensor::rand_normal(&[8, 128, 256], 0.0, 1.0, 5, dev)?;
            Work { layers, x, y }
        }
        Workload::Lm => {
            let cfg = TransformerLm {
                vocab: 28,
                d_model: 64,
                heads: 4,
                layers: 4,
                seq_len: 64,
                dropout: 0.0,
                // As the PyTorch reference (torch_mainjob.py): an untied head.
                tie_embeddings: false,
            };
            let layers = cfg.build(6, dev)?;
            let ids = |seed: u64| -> AppResult<Tensor> {
                let u = crate::tensor::rng::uniform_vec(seed, 0, 32 * 64, 0.0, 28.0);
                let v = u.into_iter().map(|x| x.floor().min(27.0)).collect();
                Ok(Tensor::from_vec(v, &[32, 64], dev)?)
            };
            Work {
                layers,
                x: ids(7)?,
                y: ids(8)?,
            }
        }
    })
}

/// The workload's loss: MSE, or cross-entropy over the vocabulary for the LM.
fn loss_of(w: Workload, out: &Var, target: &Tensor) -> crate::tensor::Result<Var> {
    match w {
        Workload::Lm => cross_entropy(out, target),
        _ => mse(out, target),
    }
}

/// The workload's optimizer: SGD lr 1e-3, or AdamW lr 3e-4 (weight decay 0.01) for the LM, as
/// the PyTorch reference.
fn optimizer_of(w: Workload) -> Box<dyn Optimizer> {
    match w {
        Workload::Lm => Box::new(AdamW::new(3e-4).with_weight_decay(0.01)),
        _ => Box::new(Sgd::new(1e-3)),
    }
}

/// What [`time_steps`] measured.
pub(super) struct Timed {
    /// One over the median step time: as the PyTorch reference (`torch_reference.py`) times its
    /// steps, so that both columns use one estimator. The median also leaves out the stretches
    /// of a fraction of a second where a shared machine runs slower (on the 2-core VM of
    /// README's sitting, MLP steps went from ~35 to ~60 ms for half a second now and then, in
    /// wgpipe's and PyTorch's step times alike), which a total-time mean counts in.
    pub(super) steps_per_sec: f64,
    /// The last step's loss.
    pub(super) loss: f32,
    /// FLOPs per measured step, from `dev`'s counter.
    pub(super) flops_per_step: f64,
    /// The CPU products of the measured steps, when timed.
    pub(super) matmuls: MatmulTimes,
}

/// The CPU products of a round's measured steps, by kind (`--matmul-times`).
#[derive(Debug, Clone, Default)]
pub struct MatmulTimes {
    pub times: Vec<MatmulTime>,
    /// The steps they were timed over.
    pub steps: usize,
}

impl MatmulTimes {
    /// Where a step's product time went, a row per kind of product, the most time first:
    /// calls per step, time per call and per step, GFLOP/s; then all of them together, against
    /// `step_seconds` (the median step).
    pub fn table(&self, step_seconds: f64) -> String {
        let steps = self.steps.max(1) as f64;
        let mut s = String::from(
            "| product (batch x m x k x n) | A | B | kernel | calls per step | us per call | ms per step | GFLOP/s |\n|---|---|---|---|---|---|---|---|\n",
        );
        for t in &self.times {
            s += &format!(
                "| {} x {} x {} x {} | {:?} | {:?} | {} | {:.1} | {:.1} | {:.3} | {:.0} |\n",
                t.batch,
                t.m,
                t.k,
                t.n,
                t.a,
                t.b,
                t.kernel,
                t.calls as f64 / steps,
                1e6 * t.seconds / t.calls.max(1) as f64,
                1e3 * t.seconds / steps,
                t.gflops()
            );
        }
        let total: f64 = self.times.iter().map(|t| t.seconds).sum::<f64>() / steps;
        s += &format!(
            "all products: {:.2} ms per step, {:.0}% of the median step ({:.2} ms)\n",
            1e3 * total,
            100.0 * total / step_seconds,
            1e3 * step_seconds
        );
        s
    }
}

/// Runs `step` for `warmup` steps, then times it step by step for up to `seconds` /
/// `max_steps`. Every step reads its loss back, so the device has finished when its clock stops.
/// With `time_matmuls`, the CPU products of the measured steps are timed too.
fn time_steps(
    args: &BenchArgs,
    dev: &Device,
    time_matmuls: bool,
    mut step: impl FnMut(u64) -> AppResult<f32>,
) -> AppResult<Timed> {
    let mut loss = 0.0;
    for i in 0..args.warmup {
        loss = step(i as u64)?;
    }
    // Timing is process-wide: turned off again on every way out, a failed step included.
    struct StopTiming;
    impl Drop for StopTiming {
        fn drop(&mut self) {
            time_cpu_matmuls(false);
        }
    }
    let stop_timing = time_matmuls.then(|| {
        take_cpu_matmul_times(); // the warm-up's
        time_cpu_matmuls(true);
        StopTiming
    });
    let flops0 = dev.flops();
    let t0 = Instant::now();
    let mut times = Vec::new();
    while times.len() < args.max_steps.max(1)
        && (times.is_empty() || t0.elapsed().as_secs_f64() < args.seconds)
    {
        let ts = Instant::now();
        loss = step((args.warmup + times.len()) as u64)?;
        times.push(ts.elapsed().as_secs_f64());
    }
    let mut matmuls = MatmulTimes::default();
    if let Some(stop) = stop_timing {
        drop(stop);
        matmuls = MatmulTimes {
            times: take_cpu_matmul_times(),
            steps: times.len(),
        };
    }
    Ok(Timed {
        steps_per_sec: 1.0 / median(&times),
        loss,
        flops_per_step: (dev.flops() - flops0) as f64 / times.len() as f64,
        matmuls,
    })
}

/// A plain training loop; on the CPU it runs on the backend's threads (`on_cpu_pool`), as
/// PyTorch's runs on its OpenMP threads.
pub(super) fn bench_plain(args: &BenchArgs, w: Workload, dev: &Device) -> AppResult<Timed> {
    let Work { layers, x, y } = workload(w, dev)?;
    let params = sequence_parameters(&layers);
    let mut opt = optimizer_of(w);
    let mut run = move || {
        time_steps(args, dev, args.matmul_times && dev.is_cpu(), |step| {
            let tape = Tape::new();
            let input = tape.constant(x.clone());
            let out = forward_all(&layers, &input, &ForwardCtx::train(0, step, 0))?;
            let loss = loss_of(w, &out, &y)?;
            tape.backward(&loss)?;
            finish_step_all(&layers)?;
            opt.step(&params)?;
            zero_grad(&params);
            Ok(loss.to_scalar()?)
        })
    };
    if dev.is_cpu() {
        crate::tensor::on_cpu_pool(run)
    } else {
        run()
    }
}

pub(super) fn bench_pipelined(args: &BenchArgs, w: Workload, dev: &Device) -> AppResult<Timed> {
    let Work { layers, x, y } = workload(w, dev)?;
    let mut pipe = Pipeline::builder(layers)
        .devices(vec![dev.clone()])
        .micro_batches(1)
        .checkpoint(CheckpointMode::Never)
        .optimizer(move || optimizer_of(w))
        .build()?;
    let loss_fn = move |o: &Var, t: &Tensor| loss_of(w, o, t);
    time_steps(args, dev, false, |_| {
        let r = pipe.train_step(&x, &y, &loss_fn)?;
        pipe.optimizer_step()?;
        Ok(r.loss)
    })
}
