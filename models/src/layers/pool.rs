//! Pooling: `MaxPool2d`, `AvgPool2d` (NCHW windows) and `GlobalAvgPool` (`[N, C, H, W]` to
//! `[N, C]`).

use wgpipe_autograd::{CostHint, ForwardCtx, Module, Param, Var};
use wgpipe_tensor::ops::Pool2dParams;
use wgpipe_tensor::Result;

use super::conv::conv_out;
use super::shape_error;

fn pool_params(kernel: usize, stride: usize, padding: usize) -> Pool2dParams {
    Pool2dParams {
        kernel: (kernel, kernel),
        stride: (stride, stride),
        padding: (padding, padding),
    }
}

fn pool_out(p: &Pool2dParams, input_shape: &[usize]) -> Vec<usize> {
    match input_shape {
        [n, c, h, w] => vec![
            *n,
            *c,
            conv_out(*h, p.kernel.0, p.stride.0, p.padding.0, 1),
            conv_out(*w, p.kernel.1, p.stride.1, p.padding.1, 1),
        ],
        _ => input_shape.to_vec(),
    }
}

fn check4(op: &'static str, x: &Var) -> Result<()> {
    if x.shape().len() != 4 {
        return Err(shape_error(
            op,
            format!("input {:?} must be [N, C, H, W]", x.shape()),
        ));
    }
    Ok(())
}

/// Max over `kernel x kernel` windows.
#[derive(Debug, Clone, Copy)]
pub struct MaxPool2d {
    pub params: Pool2dParams,
}

impl MaxPool2d {
    pub fn new(kernel: usize, stride: usize, padding: usize) -> Self {
        MaxPool2d {
            params: pool_params(kernel, stride, padding),
        }
    }
}

impl Module for MaxPool2d {
    fn name(&self) -> String {
        format!(
            "MaxPool2d({}x{}, stride {:?})",
            self.params.kernel.0, self.params.kernel.1, self.params.stride
        )
    }
    fn forward(&self, x: &Var, _ctx: &ForwardCtx) -> Result<Var> {
        check4("MaxPool2d", x)?;
        x.max_pool2d(self.params)
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        Vec::new()
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        let out = pool_out(&self.params, input_shape);
        let n: usize = out.iter().product();
        CostHint {
            param_bytes: 0,
            flops: (n * self.params.kernel.0 * self.params.kernel.1) as f64,
            // The argmax of each output.
            activation_bytes: 4 * n,
            output_shape: out,
        }
    }
}

/// Mean over `kernel x kernel` windows.
#[derive(Debug, Clone, Copy)]
pub struct AvgPool2d {
    pub params: Pool2dParams,
}

impl AvgPool2d {
    pub fn new(kernel: usize, stride: usize, padding: usize) -> Self {
        AvgPool2d {
            params: pool_params(kernel, stride, padding),
        }
    }
}

impl Module for AvgPool2d {
    fn name(&self) -> String {
        format!(
            "AvgPool2d({}x{}, stride {:?})",
            self.params.kernel.0, self.params.kernel.1, self.params.stride
        )
    }
    fn forward(&self, x: &Var, _ctx: &ForwardCtx) -> Result<Var> {
        check4("AvgPool2d", x)?;
        x.avg_pool2d(self.params)
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        Vec::new()
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        let out = pool_out(&self.params, input_shape);
        let n: usize = out.iter().product();
        CostHint {
            param_bytes: 0,
            flops: (n * self.params.kernel.0 * self.params.kernel.1) as f64,
            activation_bytes: 0,
            output_shape: out,
        }
    }
}

/// Mean over the spatial axes: `[N, C, H, W]` to `[N, C]`.
#[derive(Debug, Clone, Copy, Default)]
pub struct GlobalAvgPool;

impl Module for GlobalAvgPool {
    fn name(&self) -> String {
        "GlobalAvgPool".into()
    }
    fn forward(&self, x: &Var, _ctx: &ForwardCtx) -> Result<Var> {
        check4("GlobalAvgPool", x)?;
        x.mean(&[2, 3], false)
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        Vec::new()
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        CostHint {
            param_bytes: 0,
            flops: input_shape.iter().product::<usize>() as f64,
            activation_bytes: 0,
            output_shape: input_shape.iter().take(2).copied().collect(),
        }
    }
}
