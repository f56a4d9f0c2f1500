//! CPU backend: `Kernels` on host vectors, multi-threaded with rayon for large tensors, matmul
//! through the `gemm` crate. This file only allocates outputs and dispatches; each kind of
//! kernel lives in its own module.

use crate::backend::*;
use crate::dtype::DType;
use crate::error::Result;
use crate::layout::{numel, Layout};
use crate::memory::MemoryTracker;
use crate::raw::RawTensor;
use crate::storage::Storage;

mod attention;
mod bias_act;
mod conv;
mod cross_entropy;
mod elementwise;
mod half_cast;
mod host;
mod index;
mod math;
pub(crate) mod matmul;
mod norm;
mod optim;
pub(crate) mod par;
mod pool;
mod random;
mod reduce;
mod simd;
mod strided;
#[cfg(test)]
mod tests;

pub(crate) struct CpuKernels;

use crate::host_pool;
use host::{contig, data, exclusive_host, Out};

/// Sums contiguous CPU tensor `x`, seen as `[x.numel() / width, width]`, over its rows: `[width]`.
fn sum_columns(x: &RawTensor, width: usize) -> Result<RawTensor> {
    let mut out = Out::for_overwrite(x.memory(), width)?;
    reduce::sum_columns(&mut out.data, &contig(x));
    Ok(out.into_raw(&[width], x.memory()))
}

impl Kernels for CpuKernels {
    fn from_host(&self, mem: &MemoryTracker, src: &[f32], shape: &[usize]) -> Result<RawTensor> {
        self.from_vec(mem, src.to_vec(), shape)
    }

    fn from_vec(&self, mem: &MemoryTracker, data: Vec<f32>, shape: &[usize]) -> Result<RawTensor> {
        let alloc = Storage::reserve(mem, data.len())?;
        Ok(RawTensor::new(Storage::cpu(data, alloc), shape, mem))
    }

    fn to_host_f32(&self, x: &RawTensor) -> Result<Vec<f32>> {
        Ok(contig(x).into_owned())
    }

    fn to_host_reserving(&self, x: &RawTensor, extra: usize) -> Result<Vec<f32>> {
        if x.dtype().is_half() {
            let mut v = self.to_host(x)?;
            v.reserve_exact(extra);
            return Ok(v);
        }
        let values = contig(x);
        let mut v = Vec::with_capacity(values.len() + extra);
        v.extend_from_slice(&values);
        Ok(v)
    }

    fn widen(&self, x: &RawTensor) -> Result<RawTensor> {
        let l = x.layout();
        let bits = &x
            .storage()
            .as_cpu_half()
            .expect("widen called with a tensor whose storage is not half on the host")
            [l.offset..l.offset + l.span()];
        let mut out = Out::for_overwrite(x.memory(), bits.len())?;
        half_cast::widen(&mut out.data, bits, x.dtype());
        Ok(out.into_raw(&[bits.len()], x.memory()).with_layout(Layout {
            offset: 0,
            ..l.clone()
        }))
    }

    fn narrow(&self, x: &RawTensor, dtype: DType) -> Result<RawTensor> {
        let mem = x.memory();
        let alloc = Storage::reserve_dtype(mem, x.numel(), dtype)?;
        let mut bits = vec![0u16; x.numel()];
        half_cast::narrow(&mut bits, &contig(x), dtype);
        Ok(RawTensor::new(
            Storage::cpu_half(bits, dtype, alloc),
            x.shape(),
            mem,
        ))
    }

    fn fill(&self, mem: &MemoryTracker, shape: &[usize], value: f32) -> Result<RawTensor> {
        let n = numel(shape);
        let alloc = Storage::reserve(mem, n)?;
        Ok(RawTensor::new(
            Storage::cpu(vec![value; n], alloc),
            shape,
            mem,
        ))
    }

    fn contiguous(&self, x: &RawTensor) -> Result<RawTensor> {
        let mut out = Out::for_overwrite(x.memory(), x.numel())?;
        elementwise::copy(&mut out.data, data(x), x.layout());
        Ok(out.into_raw(x.shape(), x.memory()))
    }

    fn unary(&self, op: UnaryOp, x: &RawTensor) -> Result<RawTensor> {
        let mut out = Out::for_overwrite(x.memory(), x.numel())?;
        elementwise::unary(op, &mut out.data, data(x), x.layout());
        Ok(out.into_raw(x.shape(), x.memory()))
    }

    fn unary_grad(&self, op: UnaryOp, x: &RawTensor, g: &RawTensor) -> Result<RawTensor> {
        let mut out = Out::for_overwrite(x.memory(), x.numel())?;
        elementwise::unary_grad(op, &mut out.data, data(x), x.layout(), data(g), g.layout());
        Ok(out.into_raw(x.shape(), x.memory()))
    }

    fn bias_act(&self, op: UnaryOp, z: &RawTensor, b: &RawTensor) -> Result<RawTensor> {
        bias_act::forward(op, z, b)
    }

    fn bias_act_grad(
        &self,
        op: UnaryOp,
        z: &RawTensor,
        b: &RawTensor,
        g: &RawTensor,
    ) -> Result<RawTensor> {
        bias_act::backward(op, z, b, g)
    }

    fn sum_leading(&self, x: &RawTensor, width: usize) -> Option<Result<RawTensor>> {
        Some(sum_columns(x, width))
    }

    fn sgd_update(
        &self,
        param: &RawTensor,
        grad: &RawTensor,
        lr: f32,
    ) -> Option<Result<RawTensor>> {
        Some(optim::sgd_update(param, grad, lr))
    }

    fn binary_assign(&self, op: BinaryOp, acc: &mut RawTensor, x: &RawTensor) -> Result<()> {
        let out = exclusive_host(op.name(), acc)?;
        elementwise::binary_assign(op, out, data(x), x.layout());
        Ok(())
    }

    fn sgd_update_in_place(
        &self,
        param: &mut RawTensor,
        grad: &RawTensor,
        lr: f32,
    ) -> Option<Result<()>> {
        Some(optim::sgd_update_in_place(param, grad, lr))
    }

    fn binary(&self, op: BinaryOp, a: &RawTensor, b: &RawTensor) -> Result<RawTensor> {
        let mut out = Out::for_overwrite(a.memory(), a.numel())?;
        elementwise::binary(op, &mut out.data, data(a), a.layout(), data(b), b.layout());
        Ok(out.into_raw(a.shape(), a.memory()))
    }

    fn where_cond(&self, cond: &RawTensor, a: &RawTensor, b: &RawTensor) -> Result<RawTensor> {
        let mut out = Out::for_overwrite(a.memory(), a.numel())?;
        elementwise::where_cond(
            &mut out.data,
            data(cond),
            cond.layout(),
            data(a),
            a.layout(),
            data(b),
            b.layout(),
        );
        Ok(out.into_raw(a.shape(), a.memory()))
    }

    fn reduce_rows(
        &self,
        op: ReduceOp,
        x: &RawTensor,
        rows: usize,
        cols: usize,
    ) -> Result<RawTensor> {
        let mut out = Out::for_overwrite(x.memory(), rows)?;
        reduce::reduce_rows(op, &mut out.data, &contig(x), cols);
        Ok(out.into_raw(&[rows], x.memory()))
    }

    fn softmax_rows(
        &self,
        x: &RawTensor,
        rows: usize,
        cols: usize,
        log: bool,
    ) -> Result<RawTensor> {
        let mut out = Out::for_overwrite(x.memory(), rows * cols)?;
        reduce::softmax_rows(&mut out.data, &contig(x), cols, log);
        Ok(out.into_raw(&[rows, cols], x.memory()))
    }

    fn causal_softmax_rows(
        &self,
        x: &RawTensor,
        rows: usize,
        cols: usize,
        scale: f32,
    ) -> Result<RawTensor> {
        let mut out = Out::for_overwrite(x.memory(), rows * cols)?;
        reduce::causal_softmax_rows(&mut out.data, &contig(x), cols, scale);
        Ok(out.into_raw(&[rows, cols], x.memory()))
    }

    fn causal_attention(
        &self,
        [(q, lq), (k, lk), (v, lv)]: [(&RawTensor, MatLayout); 3],
        y_at: MatLayout,
        d: HeadDims,
        scale: f32,
    ) -> Option<Result<(RawTensor, RawTensor)>> {
        if !attention::chosen() {
            return None;
        }
        let run = || {
            let mem = q.memory();
            let n = d.batch * d.t * d.dh;
            let mut y = Out::for_overwrite(mem, n)?;
            let mut p = Out::for_overwrite(mem, d.batch * d.t * d.t)?;
            let heads = |x, layout| attention::Heads {
                data: data(x),
                layout,
            };
            let qkv = [heads(q, lq), heads(k, lk), heads(v, lv)];
            let y_heads = attention::HeadsMut::new(&mut y.data, y_at, d);
            attention::forward(y_heads, &mut p.data, qkv, d, scale);
            Ok((y.into_raw(&[n], mem), p.into_raw(&[d.batch, d.t, d.t], mem)))
        };
        Some(run())
    }

    fn causal_attention_backward(
        &self,
        [(q, lq), (k, lk), (v, lv)]: [(&RawTensor, MatLayout); 3],
        p: &RawTensor,
        (g, lg): (&RawTensor, MatLayout),
        at: [MatLayout; 3],
        d: HeadDims,
        scale: f32,
    ) -> Option<Result<[RawTensor; 3]>> {
        if !attention::chosen() {
            return None;
        }
        let run = || {
            let mem = q.memory();
            let n = d.batch * d.t * d.dh;
            let mut grads = [
                Out::for_overwrite(mem, n)?,
                Out::for_overwrite(mem, n)?,
                Out::for_overwrite(mem, n)?,
            ];
            let heads = |x, layout| attention::Heads {
                data: data(x),
                layout,
            };
            let qkv = [heads(q, lq), heads(k, lk), heads(v, lv)];
            let [gq, gk, gv] = &mut grads;
            let outs = [(gq, at[0]), (gk, at[1]), (gv, at[2])]
                .map(|(o, l)| attention::HeadsMut::new(&mut o.data, l, d));
            attention::backward(outs, qkv, &contig(p), heads(g, lg), d, scale);
            Ok(grads.map(|o| o.into_raw(&[n], mem)))
        };
        Some(run())
    }

    fn softmax_backward_rows(
        &self,
        y: &RawTensor,
        g: &RawTensor,
        rows: usize,
        cols: usize,
        scale: f32,
    ) -> Result<RawTensor> {
        let mut out = Out::for_overwrite(y.memory(), rows * cols)?;
        reduce::softmax_backward_rows(&mut out.data, &contig(y), &contig(g), cols, scale);
        Ok(out.into_raw(&[rows, cols], y.memory()))
    }

    fn matmul_grouped_batches(&self) -> bool {
        true
    }

    fn matmul(
        &self,
        a: &RawTensor,
        la: MatLayout,
        b: &RawTensor,
        lb: MatLayout,
        dims: MatDims,
    ) -> Result<RawTensor> {
        let mut out = Out::for_overwrite(a.memory(), dims.batch * dims.m * dims.n)?;
        matmul::matmul(&mut out.data, data(a), la, data(b), lb, dims);
        Ok(out.into_raw(&[dims.batch, dims.m, dims.n], a.memory()))
    }

    fn layer_norm_rows(
        &self,
        x: &RawTensor,
        gamma: &RawTensor,
        beta: &RawTensor,
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<(RawTensor, RawTensor, RawTensor)> {
        let mem = x.memory();
        let (ay, am, ar) = (
            Storage::reserve(mem, rows * cols)?,
            Storage::reserve(mem, rows)?,
            Storage::reserve(mem, rows)?,
        );
        let (mut y, mut mean, mut rstd) = (
            host_pool::take_for_overwrite(rows * cols),
            host_pool::take_for_overwrite(rows),
            host_pool::take_for_overwrite(rows),
        );
        norm::layer_norm_rows(
            &mut y,
            &mut mean,
            &mut rstd,
            &contig(x),
            &contig(gamma),
            &contig(beta),
            eps,
        );
        Ok((
            Out { data: y, alloc: ay }.into_raw(&[rows, cols], mem),
            Out {
                data: mean,
                alloc: am,
            }
            .into_raw(&[rows], mem),
            Out {
                data: rstd,
                alloc: ar,
            }
            .into_raw(&[rows], mem),
        ))
    }

    fn cross_entropy_rows(
        &self,
        x: &RawTensor,
        targets: &RawTensor,
        rows: usize,
        cols: usize,
    ) -> Result<(RawTensor, RawTensor, RawTensor)> {
        debug_assert_eq!(x.numel(), rows * cols);
        let mem = x.memory();
        let mut loss = Out::for_overwrite(mem, rows)?;
        let mut max = Out::for_overwrite(mem, rows)?;
        let mut logsum = Out::for_overwrite(mem, rows)?;
        cross_entropy::cross_entropy_rows(
            &mut loss.data,
            &mut max.data,
            &mut logsum.data,
            &contig(x),
            &contig(targets),
        );
        Ok((
            loss.into_raw(&[rows], mem),
            max.into_raw(&[rows], mem),
            logsum.into_raw(&[rows], mem),
        ))
    }

    fn cross_entropy_backward_rows(
        &self,
        x: &RawTensor,
        targets: &RawTensor,
        max: &RawTensor,
        logsum: &RawTensor,
        g: &RawTensor,
        rows: usize,
        cols: usize,
    ) -> Result<RawTensor> {
        let mut out = Out::for_overwrite(x.memory(), rows * cols)?;
        cross_entropy::cross_entropy_backward_rows(
            &mut out.data,
            &contig(x),
            &contig(targets),
            &contig(max),
            &contig(logsum),
            &contig(g),
        );
        Ok(out.into_raw(&[rows, cols], x.memory()))
    }

    fn add_layer_norm_rows(
        &self,
        x: &RawTensor,
        r: &RawTensor,
        gamma: &RawTensor,
        beta: &RawTensor,
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<(RawTensor, RawTensor, RawTensor, RawTensor)> {
        let mem = x.memory();
        let mut s = Out::for_overwrite(mem, rows * cols)?;
        let mut y = Out::for_overwrite(mem, rows * cols)?;
        let mut mean = Out::for_overwrite(mem, rows)?;
        let mut rstd = Out::for_overwrite(mem, rows)?;
        norm::add_layer_norm_rows(
            &mut s.data,
            &mut y.data,
            &mut mean.data,
            &mut rstd.data,
            &contig(x),
            &contig(r),
            &contig(gamma),
            &contig(beta),
            eps,
        );
        Ok((
            s.into_raw(&[rows, cols], mem),
            y.into_raw(&[rows, cols], mem),
            mean.into_raw(&[rows], mem),
            rstd.into_raw(&[rows], mem),
        ))
    }

    fn layer_norm_backward_rows(
        &self,
        x: &RawTensor,
        mean: &RawTensor,
        rstd: &RawTensor,
        gamma: &RawTensor,
        g: &RawTensor,
        carry: Option<&RawTensor>,
        rows: usize,
        cols: usize,
    ) -> Result<RawTensor> {
        let mut out = Out::for_overwrite(x.memory(), rows * cols)?;
        let carry = carry.map(contig);
        norm::layer_norm_backward_rows(
            &mut out.data,
            &contig(x),
            &contig(mean),
            &contig(rstd),
            &contig(gamma),
            &contig(g),
            carry.as_deref(),
        );
        Ok(out.into_raw(&[rows, cols], x.memory()))
    }

    fn index_select(
        &self,
        x: &RawTensor,
        idx: &RawTensor,
        outer: usize,
        dim: usize,
        inner: usize,
    ) -> Result<RawTensor> {
        let n = idx.numel();
        let mut out = Out::for_overwrite(x.memory(), outer * n * inner)?;
        index::index_select(&mut out.data, &contig(x), &contig(idx), dim, inner);
        Ok(out.into_raw(&[outer, n, inner], x.memory()))
    }

    fn index_add(
        &self,
        src: &RawTensor,
        idx: &RawTensor,
        outer: usize,
        dim: usize,
        inner: usize,
    ) -> Result<RawTensor> {
        let mut out = Out::zeros(src.memory(), outer * dim * inner)?;
        index::index_add(&mut out.data, &contig(src), &contig(idx), dim, inner);
        Ok(out.into_raw(&[outer, dim, inner], src.memory()))
    }

    fn gather(
        &self,
        x: &RawTensor,
        idx: &RawTensor,
        outer: usize,
        dim: usize,
        inner: usize,
    ) -> Result<RawTensor> {
        let n = idx.numel().checked_div(outer * inner).unwrap_or(0);
        let mut out = Out::for_overwrite(x.memory(), outer * n * inner)?;
        index::gather(&mut out.data, &contig(x), &contig(idx), n, dim, inner);
        Ok(out.into_raw(&[outer, n, inner], x.memory()))
    }

    fn scatter_add(
        &self,
        src: &RawTensor,
        idx: &RawTensor,
        outer: usize,
        dim: usize,
        inner: usize,
    ) -> Result<RawTensor> {
        let n = idx.numel().checked_div(outer * inner).unwrap_or(0);
        let mut out = Out::zeros(src.memory(), outer * dim * inner)?;
        index::scatter_add(&mut out.data, &contig(src), &contig(idx), n, dim, inner);
        Ok(out.into_raw(&[outer, dim, inner], src.memory()))
    }

    fn concat(&self, xs: &[&RawTensor], axis: usize, out_shape: &[usize]) -> Result<RawTensor> {
        let mem = xs[0].memory();
        let mut out = Out::for_overwrite(mem, numel(out_shape))?;
        let inner: usize = out_shape[axis + 1..].iter().product();
        let row = out_shape[axis] * inner;
        let readers: Vec<_> = xs
            .iter()
            .map(|x| elementwise::ViewReader::new(x.layout()))
            .collect();
        par::for_rows(&mut out.data, row, |o0, chunk| {
            for (k, dst) in chunk.chunks_mut(row).enumerate() {
                let o = o0 + k;
                let mut at = 0;
                for (x, r) in xs.iter().zip(&readers) {
                    let len = x.shape()[axis] * inner;
                    r.copy_range(&mut dst[at..at + len], data(x), o * len);
                    at += len;
                }
            }
        });
        Ok(out.into_raw(out_shape, mem))
    }

    fn im2col(&self, x: &RawTensor, g: &Conv2dGeometry) -> Result<RawTensor> {
        let (rows, cols) = (g.col_rows(), g.col_cols());
        let mut out = Out::for_overwrite(x.memory(), g.n * g.groups * rows * cols)?;
        conv::im2col(&mut out.data, &contig(x), g);
        Ok(out.into_raw(&[g.n, g.groups, rows, cols], x.memory()))
    }

    fn col2im(&self, cols: &RawTensor, g: &Conv2dGeometry) -> Result<RawTensor> {
        let mut out = Out::zeros(cols.memory(), g.n * g.c_in * g.h * g.w)?;
        conv::col2im(&mut out.data, &contig(cols), g);
        Ok(out.into_raw(&[g.n, g.c_in, g.h, g.w], cols.memory()))
    }

    fn max_pool2d(&self, x: &RawTensor, g: &Pool2dGeometry) -> Result<(RawTensor, RawTensor)> {
        let mem = x.memory();
        let n = g.n * g.c * g.h_out * g.w_out;
        let (ay, aa) = (Storage::reserve(mem, n)?, Storage::reserve(mem, n)?);
        let (mut y, mut am) = (
            host_pool::take_for_overwrite(n),
            host_pool::take_for_overwrite(n),
        );
        pool::max_pool2d(&mut y, &mut am, &contig(x), g);
        let shape = [g.n, g.c, g.h_out, g.w_out];
        Ok((
            Out { data: y, alloc: ay }.into_raw(&shape, mem),
            Out {
                data: am,
                alloc: aa,
            }
            .into_raw(&shape, mem),
        ))
    }

    fn max_pool2d_backward(
        &self,
        dy: &RawTensor,
        argmax: &RawTensor,
        g: &Pool2dGeometry,
    ) -> Result<RawTensor> {
        let mut out = Out::zeros(dy.memory(), g.n * g.c * g.h * g.w)?;
        pool::max_pool2d_backward(&mut out.data, &contig(dy), &contig(argmax), g);
        Ok(out.into_raw(&[g.n, g.c, g.h, g.w], dy.memory()))
    }

    fn avg_pool2d(&self, x: &RawTensor, g: &Pool2dGeometry) -> Result<RawTensor> {
        let mut out = Out::for_overwrite(x.memory(), g.n * g.c * g.h_out * g.w_out)?;
        pool::avg_pool2d(&mut out.data, &contig(x), g);
        Ok(out.into_raw(&[g.n, g.c, g.h_out, g.w_out], x.memory()))
    }

    fn avg_pool2d_backward(&self, dy: &RawTensor, g: &Pool2dGeometry) -> Result<RawTensor> {
        let mut out = Out::zeros(dy.memory(), g.n * g.c * g.h * g.w)?;
        pool::avg_pool2d_backward(&mut out.data, &contig(dy), g);
        Ok(out.into_raw(&[g.n, g.c, g.h, g.w], dy.memory()))
    }

    fn dropout_mask(
        &self,
        mem: &MemoryTracker,
        shape: &[usize],
        p: f32,
        seed: u64,
        offset: u64,
    ) -> Result<RawTensor> {
        let mut out = Out::for_overwrite(mem, numel(shape))?;
        random::dropout_mask(&mut out.data, p, seed, offset);
        Ok(out.into_raw(shape, mem))
    }

    fn adam_update(
        &self,
        param: &RawTensor,
        grad: &RawTensor,
        m: &RawTensor,
        v: &RawTensor,
        hp: &AdamStep,
    ) -> Result<(RawTensor, RawTensor, RawTensor)> {
        let mem = param.memory();
        let n = param.numel();
        let (ap, am, av) = (
            Storage::reserve(mem, n)?,
            Storage::reserve(mem, n)?,
            Storage::reserve(mem, n)?,
        );
        let (mut p2, mut m2, mut v2) = (
            host_pool::take_for_overwrite(n),
            host_pool::take_for_overwrite(n),
            host_pool::take_for_overwrite(n),
        );
        optim::adam(
            &mut p2,
            &mut m2,
            &mut v2,
            Some((&contig(param), &contig(m), &contig(v))),
            &contig(grad),
            hp,
        );
        let shape = param.shape();
        Ok((
            Out {
                data: p2,
                alloc: ap,
            }
            .into_raw(shape, mem),
            Out {
                data: m2,
                alloc: am,
            }
            .into_raw(shape, mem),
            Out {
                data: v2,
                alloc: av,
            }
            .into_raw(shape, mem),
        ))
    }

    fn adam_update_in_place(
        &self,
        param: &mut RawTensor,
        grad: &RawTensor,
        m: &mut RawTensor,
        v: &mut RawTensor,
        hp: &AdamStep,
    ) -> Result<()> {
        let g = contig(grad);
        let (p, m, v) = (
            exclusive_host("adam_update", param)?,
            exclusive_host("adam_update", m)?,
            exclusive_host("adam_update", v)?,
        );
        optim::adam(p, m, v, None, &g, hp);
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}
