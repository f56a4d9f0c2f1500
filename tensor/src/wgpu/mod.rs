//! wgpu backend (placeholder until the runtime lands).
#![allow(unused_variables)]
use crate::backend::*;
use crate::device::Device;
use crate::error::Result;
use crate::tensor::Tensor;

pub(crate) struct WgpuContext {
    info: AdapterInfo,
}
pub(crate) struct GpuBuffer;

/// One wgpu adapter as discovered on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterInfo {
    pub index: usize,
    pub name: String,
    pub backend: String,
    pub is_discrete: bool,
    pub is_software: bool,
}

pub(crate) fn list_adapters() -> Vec<AdapterInfo> {
    Vec::new()
}

impl WgpuContext {
    pub(crate) fn open(index: usize) -> Result<WgpuContext> {
        Err(crate::error::Error::Device(format!("no adapter {index}")))
    }
    pub(crate) fn adapter_info(&self) -> &AdapterInfo {
        &self.info
    }
}

impl Kernels for WgpuContext {
    fn from_host(&self, dev: &Device, data: &[f32], shape: &[usize]) -> Result<Tensor> {
        unimplemented!()
    }
    fn to_host(&self, x: &Tensor) -> Result<Vec<f32>> {
        unimplemented!()
    }
    fn fill(&self, dev: &Device, shape: &[usize], value: f32) -> Result<Tensor> {
        unimplemented!()
    }
    fn contiguous(&self, x: &Tensor) -> Result<Tensor> {
        unimplemented!()
    }
    fn unary(&self, op: UnaryOp, x: &Tensor) -> Result<Tensor> {
        unimplemented!()
    }
    fn binary(&self, op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        unimplemented!()
    }
    fn where_cond(&self, cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        unimplemented!()
    }
    fn reduce_rows(&self, op: ReduceOp, x: &Tensor, rows: usize, cols: usize) -> Result<Tensor> {
        unimplemented!()
    }
    fn softmax_rows(&self, x: &Tensor, rows: usize, cols: usize, log: bool) -> Result<Tensor> {
        unimplemented!()
    }
    fn matmul(
        &self,
        a: &Tensor,
        la: MatLayout,
        b: &Tensor,
        lb: MatLayout,
        dims: MatDims,
    ) -> Result<Tensor> {
        unimplemented!()
    }
    fn layer_norm_rows(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        beta: &Tensor,
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        unimplemented!()
    }
    fn index_select(
        &self,
        x: &Tensor,
        idx: &Tensor,
        outer: usize,
        dim: usize,
        inner: usize,
    ) -> Result<Tensor> {
        unimplemented!()
    }
    fn index_add(
        &self,
        src: &Tensor,
        idx: &Tensor,
        outer: usize,
        dim: usize,
        inner: usize,
    ) -> Result<Tensor> {
        unimplemented!()
    }
    fn gather(
        &self,
        x: &Tensor,
        idx: &Tensor,
        outer: usize,
        dim: usize,
        inner: usize,
    ) -> Result<Tensor> {
        unimplemented!()
    }
    fn scatter_add(
        &self,
        src: &Tensor,
        idx: &Tensor,
        outer: usize,
        dim: usize,
        inner: usize,
    ) -> Result<Tensor> {
        unimplemented!()
    }
    fn concat(&self, xs: &[&Tensor], axis: usize, out_shape: &[usize]) -> Result<Tensor> {
        unimplemented!()
    }
    fn im2col(&self, x: &Tensor, g: &Conv2dGeometry) -> Result<Tensor> {
        unimplemented!()
    }
    fn col2im(&self, cols: &Tensor, g: &Conv2dGeometry) -> Result<Tensor> {
        unimplemented!()
    }
    fn max_pool2d(&self, x: &Tensor, g: &Pool2dGeometry) -> Result<(Tensor, Tensor)> {
        unimplemented!()
    }
    fn max_pool2d_backward(
        &self,
        dy: &Tensor,
        argmax: &Tensor,
        g: &Pool2dGeometry,
    ) -> Result<Tensor> {
        unimplemented!()
    }
    fn avg_pool2d(&self, x: &Tensor, g: &Pool2dGeometry) -> Result<Tensor> {
        unimplemented!()
    }
    fn avg_pool2d_backward(&self, dy: &Tensor, g: &Pool2dGeometry) -> Result<Tensor> {
        unimplemented!()
    }
    fn dropout_mask(
        &self,
        dev: &Device,
        shape: &[usize],
        p: f32,
        seed: u64,
        offset: u64,
    ) -> Result<Tensor> {
        unimplemented!()
    }
    fn adam_update(
        &self,
        param: &Tensor,
        grad: &Tensor,
        m: &Tensor,
        v: &Tensor,
        hp: &AdamStep,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        unimplemented!()
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}
