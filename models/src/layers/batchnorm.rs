//! `BatchNorm2d` with deferred running statistics, as GPipe and torchgpipe do it.
//!
//! * Training: each micro-batch is normalised by its own statistics (mean and biased variance
//!   over every axis except the channel axis 1).
//! * The statistics of every training forward that is not a recompute are accumulated
//!   (count, mean, biased variance per micro-batch), and `finish_step` folds them into the
//!   running statistics ONCE per mini-batch, from the statistics of the whole mini-batch:
//!   `running = (1 - momentum) * running + momentum * stat`, with the unbiased variance for
//!   `running_var`, as PyTorch. The per-micro-batch pieces are combined exactly (Chan et al.'s
//!   pairwise formula), so the result equals the whole-mini-batch statistics however the
//!   mini-batch was split.
//! * Eval (ctx not training, or `set_train(false)`): normalised by the running statistics.
//!
//! Parameters `weight` (1), `bias` (0); buffers `running_mean` (0), `running_var` (1).
//! Accepts `[N, C, ...]` (so it also serves as BatchNorm1d on `[N, C]`).

use std::sync::Mutex;

use wgpipe_autograd::{CostHint, ForwardCtx, Module, Param, Var};
use wgpipe_tensor::{DType, Device, Result, Tensor};

use super::{f32_bytes, shape_error};

/// Statistics of one micro-batch: element count per channel, mean, biased variance (`[C]`).
struct Piece {
    count: usize,
    mean: Tensor,
    var: Tensor,
}

pub struct BatchNorm2d {
    pub weight: Param,
    pub bias: Param,
    pub running_mean: Param,
    pub running_var: Param,
    channels: usize,
    eps: f32,
    momentum: f32,
    train: bool,
    pending: Mutex<Vec<Piece>>,
}

impl BatchNorm2d {
    /// eps 1e-5, momentum 0.1 (PyTorch's defaults).
    pub fn new(channels: usize, dev: &Device) -> Result<Self> {
        BatchNorm2d::with_options(channels, 1e-5, 0.1, dev)
    }

    pub fn with_options(channels: usize, eps: f32, momentum: f32, dev: &Device) -> Result<Self> {
        let rm = Param::new("running_mean", Tensor::zeros(&[channels], dev)?);
        let rv = Param::new("running_var", Tensor::ones(&[channels], dev)?);
        rm.set_trainable(false);
        rv.set_trainable(false);
        Ok(BatchNorm2d {
            weight: Param::new("weight", Tensor::ones(&[channels], dev)?),
            bias: Param::new("bias", Tensor::zeros(&[channels], dev)?),
            running_mean: rm,
            running_var: rv,
            channels,
            eps,
            momentum,
            train: true,
            pending: Mutex::new(Vec::new()),
        })
    }

    pub fn channels(&self) -> usize {
        self.channels
    }

    /// Number of micro-batches whose statistics wait for `finish_step`.
    pub fn pending_pieces(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Piece>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `[1, C, 1, ...]` for an input of rank `rank`.
    fn channel_shape(&self, rank: usize) -> Vec<usize> {
        let mut s = vec![1; rank];
        s[1] = self.channels;
        s
    }
}

impl Module for BatchNorm2d {
    fn name(&self) -> String {
        format!("BatchNorm2d({})", self.channels)
    }

    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let shape = x.shape().to_vec();
        if shape.len() < 2 || shape[1] != self.channels {
            return Err(shape_error(
                "BatchNorm2d",
                format!("input {shape:?} must be [N, {}, ...]", self.channels),
            ));
        }
        // On the stream's dtype (autocast): parameters and running statistics are f32 and used
        // through copies in the input's dtype; means accumulate in f32 in the kernels.
        let (t, d) = (x.tape(), x.value().dtype());
        let cs = self.channel_shape(shape.len());
        let gamma = x.param(&self.weight)?.reshape(&cs)?;
        let beta = x.param(&self.bias)?.reshape(&cs)?;
        if !(ctx.train && self.train) {
            let rm = t.constant(self.running_mean.value_in(d)?.reshape(&cs)?);
            let rv = t.constant(self.running_var.value_in(d)?.reshape(&cs)?);
            let scale = rv.add_scalar(self.eps)?.rsqrt()?.mul(&gamma)?;
            return x.sub(&rm)?.mul(&scale)?.add(&beta);
        }
        let axes: Vec<isize> = std::iter::once(0).chain(2..shape.len() as isize).collect();
        let mean = x.mean(&axes, true)?;
        let xc = x.sub(&mean)?;
        let var = xc.square()?.mean(&axes, true)?;
        let y = xc
            .mul(&var.add_scalar(self.eps)?.rsqrt()?)?
            .mul(&gamma)?
            .add(&beta)?;
        if !(ctx.recompute || t.is_recompute()) {
            let count = shape.iter().product::<usize>() / self.channels;
            // The running statistics stay f32 whatever the stream's dtype.
            self.lock().push(Piece {
                count,
                mean: mean
                    .value()
                    .to_dtype(DType::F32)?
                    .reshape(&[self.channels])?,
                var: var
                    .value()
                    .to_dtype(DType::F32)?
                    .reshape(&[self.channels])?,
            });
        }
        Ok(y)
    }

    fn parameters(&self) -> Vec<(String, Param)> {
        vec![
            ("weight".into(), self.weight.clone()),
            ("bias".into(), self.bias.clone()),
        ]
    }

    fn buffers(&self) -> Vec<(String, Param)> {
        vec![
            ("running_mean".into(), self.running_mean.clone()),
            ("running_var".into(), self.running_var.clone()),
        ]
    }

    fn set_train(&mut self, train: bool) {
        self.train = train;
    }

    /// Folds the statistics of every micro-batch since the last call into the running ones.
    fn finish_step(&self) -> Result<()> {
        let pieces = std::mem::take(&mut *self.lock());
        if pieces.is_empty() {
            return Ok(());
        }
        let n: usize = pieces.iter().map(|p| p.count).sum();
        // mean = sum_b (n_b / n) mean_b
        let mut mean: Option<Tensor> = None;
        for p in &pieces {
            let term = p.mean.mul_scalar(p.count as f32 / n as f32)?;
            mean = Some(match mean {
                Some(m) => m.add(&term)?,
                None => term,
            });
        }
        let mean = mean.expect("at least one piece");
        // M2 = sum_b n_b * (var_b + (mean_b - mean)^2)
        let mut m2: Option<Tensor> = None;
        for p in &pieces {
            let term = p
                .var
                .add(&p.mean.sub(&mean)?.square()?)?
                .mul_scalar(p.count as f32)?;
            m2 = Some(match m2 {
                Some(m) => m.add(&term)?,
                None => term,
            });
        }
        let unbiased = m2
            .expect("at least one piece")
            .div_scalar(n.saturating_sub(1).max(1) as f32)?;
        let m = self.momentum;
        let rm = self.running_mean.value();
        let rv = self.running_var.value();
        let rm = rm.mul_scalar(1.0 - m)?.add(&mean.mul_scalar(m)?)?;
        let rv = rv.mul_scalar(1.0 - m)?.add(&unbiased.mul_scalar(m)?)?;
        self.running_mean.set_value(rm);
        self.running_var.set_value(rv);
        Ok(())
    }

    fn cost(&self, input_shape: &[usize]) -> CostHint {
        let n = input_shape.iter().product::<usize>();
        CostHint {
            param_bytes: 8 * self.channels,
            flops: 8.0 * n as f64,
            // The centred input and the normalised output are kept.
            activation_bytes: 2 * f32_bytes(input_shape),
            output_shape: input_shape.to_vec(),
        }
    }
}
