//! CPU backend: `Kernels` on host vectors, multi-threaded with rayon for large tensors, matmul
//! through the `gemm` crate. This file only allocates outputs and dispatches; each kind of
//! kernel lives in its own module.

use crate::backend::*;
use crate::device::Device;
use crate::dtype::DType;
use crate::error::Result;
use crate::layout::{numel, Layout};
use crate::storage::Storage;
use crate::tensor::Tensor;

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

/// The plain SGD step `param - lr * grad` in one pass (CPU tensors of one shape), with exactly the
/// arithmetic of `param.sub(&grad.mul_scalar(lr)?)`: `p - (g * lr + 0.0)`.
fn sgd_update(param: &Tensor, grad: &Tensor, lr: f32) -> Result<Tensor> {
    let mut out = Out::for_overwrite(param.device(), param.numel())?;
    elementwise::map2(
        &mut out.data,
        data(param),
        param.layout(),
        data(grad),
        grad.layout(),
        move |p, g| p - (g * lr + 0.0),
    );
    Ok(out.into_tensor(param.shape(), param.device()))
}

/// [`sgd_update`] written into exclusive `param`: `p = p - (g * lr + 0.0)`.
fn sgd_update_in_place(param: &mut Tensor, grad: &Tensor, lr: f32) -> Result<()> {
    let p = exclusive_host("sgd_update", param)?;
    elementwise::map2_assign(p, data(grad), grad.layout(), move |p, g| p - (g * lr + 0.0));
    Ok(())
}

/// Sums contiguous CPU tensor `x`, seen as `[x.numel() / width, width]`, over its rows: `[width]`.
fn sum_columns(x: &Tensor, width: usize) -> Result<Tensor> {
    let mut out = Out::for_overwrite(x.device(), width)?;
    reduce::sum_columns(&mut out.data, &contig(x));
    Ok(out.into_tensor(&[width], x.device()))
}

impl Kernels for CpuKernels {
    fn from_host(&self, dev: &Device, src: &[f32], shape: &[usize]) -> Result<Tensor> {
        self.from_vec(dev, src.to_vec(), shape)
    }

    fn from_vec(&self, dev: &Device, data: Vec<f32>, shape: &[usize]) -> Result<Tensor> {
        let alloc = Storage::reserve(dev, data.len())?;
        Ok(Tensor::from_storage(Storage::cpu(data, alloc), shape, dev))
    }

    fn to_host_f32(&self, x: &Tensor) -> Result<Vec<f32>> {
        Ok(contig(x).into_owned())
    }

    fn to_host_reserving(&self, x: &Tensor, extra: usize) -> Result<Vec<f32>> {
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

    fn widen(&self, x: &Tensor) -> Result<Tensor> {
        let l = x.layout();
        let bits = &x
            .storage()
            .as_cpu_half()
            .expect("widen called with a tensor whose storage is not half on the host")
            [l.offset..l.offset + l.span()];
        let mut out = Out::for_overwrite(x.device(), bits.len())?;
        half_cast::widen(&mut out.data, bits, x.dtype());
        Ok(out
            .into_tensor(&[bits.len()], x.device())
            .with_layout(Layout {
                offset: 0,
                ..l.clone()
            }))
    }

    fn narrow(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        let dev = x.device();
        let alloc = Storage::reserve_dtype(dev, x.numel(), dtype)?;
        let mut bits = vec![0u16; x.numel()];
        half_cast::narrow(&mut bits, &contig(x), dtype);
        Ok(Tensor::from_storage(
            Storage::cpu_half(bits, dtype, alloc),
            x.shape(),
            dev,
        ))
    }

    fn fill(&self, dev: &Device, shape: &[usize], value: f32) -> Result<Tensor> {
        let n = numel(shape);
        let alloc = Storage::reserve(dev, n)?;
        Ok(Tensor::from_storage(
            Storage::cpu(vec![value; n], alloc),
            shape,
            dev,
        ))
    }

    fn contiguous(&self, x: &Tensor) -> Result<Tensor> {
        let mut out = Out::for_overwrite(x.device(), x.numel())?;
        elementwise::copy(&mut out.data, data(x), x.layout());
        Ok(out.into_tensor(x.shape(), x.device()))
    }

    fn unary(&self, op: UnaryOp, x: &Tensor) -> Result<Tensor> {
        let mut out = Out::for_overwrite(x.device(), x.numel())?;
        elementwise::unary(op, &mut out.data, data(x), x.layout());
        Ok(out.into_tensor(x.shape(), x.device()))
    }

    fn unary_grad(&self, op: UnaryOp, x: &Tensor, g: &Tensor) -> Result<Tensor> {
        let mut out = Out::for_overwrite(x.device(), x.numel())?;
        elementwise::unary_grad(op, &mut out.data, data(x), x.layout(), data(g), g.layout());
        Ok(out.into_tensor(x.shape(), x.device()))
    }

    fn bias_act(&self, op: UnaryOp, z: &Tensor, b: &Tensor) -> Result<Tensor> {
        let mut out = Out::for_overwrite(z.device(), z.numel())?;
        bias_act::bias_act(op, &mut out.data, &contig(z), &contig(b), None);
        Ok(out.into_tensor(z.shape(), z.device()))
    }

    fn bias_act_grad(&self, op: UnaryOp, z: &Tensor, b: &Tensor, g: &Tensor) -> Result<Tensor> {
        let mut out = Out::for_overwrite(z.device(), z.numel())?;
        let g = contig(g);
        bias_act::bias_act(op, &mut out.data, &contig(z), &contig(b), Some(&g));
        Ok(out.into_tensor(z.shape(), z.device()))
    }

    fn sum_leading(&self, x: &Tensor, width: usize) -> Option<Result<Tensor>> {
        Some(sum_columns(x, width))
    }

    fn sgd_update(&self, param: &Tensor, grad: &Tensor, lr: f32) -> Option<Result<Tensor>> {
        Some(sgd_update(param, grad, lr))
    }

    fn binary_assign(&self, op: BinaryOp, acc: &mut Tensor, x: &Tensor) -> Result<()> {
        let out = exclusive_host(op.name(), acc)?;
        elementwise::binary_assign(op, out, data(x), x.layout());
        Ok(())
    }

    fn sgd_update_in_place(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        lr: f32,
    ) -> Option<Result<()>> {
        Some(sgd_update_in_place(param, grad, lr))
    }

    fn binary(&self, op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let mut out = Out::for_overwrite(a.device(), a.numel())?;
        elementwise::binary(op, &mut out.data, data(a), a.layout(), data(b), b.layout());
        Ok(out.into_tensor(a.shape(), a.device()))
    }

    fn where_cond(&self, cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let mut out = Out::for_overwrite(a.device(), a.numel())?;
        elementwise::where_cond(
            &mut out.data,
            data(cond),
            cond.layout(),
            data(a),
            a.layout(),
            data(b),
            b.layout(),
        );
        Ok(out.into_tensor(a.shape(), a.device()))
    }

    fn reduce_rows(&self, op: ReduceOp, x: &Tensor, rows: usize, cols: usize) -> Result<Tensor> {
        let mut out = Out::for_overwrite(x.device(), rows)?;
        reduce::reduce_rows(op, &mut out.data, &contig(x), cols);
        Ok(out.into_tensor(&[rows], x.device()))
    }

    fn softmax_rows(&self, x: &Tensor, rows: usize, cols: usize, log: bool) -> Result<Tensor> {
        let mut out = Out::for_overwrite(x.device(), rows * cols)?;
        reduce::softmax_rows(&mut out.data, &contig(x), cols, log);
        Ok(out.into_tensor(&[rows, cols], x.device()))
    }

    fn causal_softmax_rows(
        &self,
        x: &Tensor,
        rows: usize,
        cols: usize,
        scale: f32,
    ) -> Result<Tensor> {
        let mut out = Out::for_overwrite(x.device(), rows * cols)?;
        reduce::causal_softmax_rows(&mut out.data, &contig(x), cols, scale);
        Ok(out.into_tensor(&[rows, cols], x.device()))
    }

    fn causal_attention(
        &self,
        [(q, lq), (k, lk), (v, lv)]: [(&Tensor, MatLayout); 3],
        y_at: MatLayout,
        d: HeadDims,
        scale: f32,
    ) -> Option<Result<(Tensor, Tensor)>> {
        if !attention::chosen() {
            return None;
        }
        let run = || {
            let dev = q.device();
            let n = d.batch * d.t * d.dh;
            let mut y = Out::for_overwrite(dev, n)?;
            let mut p = Out::for_overwrite(dev, d.batch * d.t * d.t)?;
            let heads = |x, layout| attention::Heads {
                data: data(x),
                layout,
            };
            let qkv = [heads(q, lq), heads(k, lk), heads(v, lv)];
            let y_heads = attention::HeadsMut::new(&mut y.data, y_at, d);
            attention::forward(y_heads, &mut p.data, qkv, d, scale);
            Ok((
                y.into_tensor(&[n], dev),
                p.into_tensor(&[d.batch, d.t, d.t], dev),
            ))
        };
        Some(run())
    }

    fn causal_attention_backward(
        &self,
        [(q, lq), (k, lk), (v, lv)]: [(&Tensor, MatLayout); 3],
        p: &Tensor,
        (g, lg): (&Tensor, MatLayout),
        at: [MatLayout; 3],
        d: HeadDims,
        scale: f32,
    ) -> Option<Result<[Tensor; 3]>> {
        if !attention::chosen() {
            return None;
        }
        let run = || {
            let dev = q.device();
            let n = d.batch * d.t * d.dh;
            let mut grads = [
                Out::for_overwrite(dev, n)?,
                Out::for_overwrite(dev, n)?,
                Out::for_overwrite(dev, n)?,
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
            Ok(grads.map(|o| o.into_tensor(&[n], dev)))
        };
        Some(run())
    }

    fn softmax_backward_rows(
        &self,
        y: &Tensor,
        g: &Tensor,
        rows: usize,
        cols: usize,
        scale: f32,
    ) -> Result<Tensor> {
        let mut out = Out::for_overwrite(y.device(), rows * cols)?;
        reduce::softmax_backward_rows(&mut out.data, &contig(y), &contig(g), cols, scale);
        Ok(out.into_tensor(&[rows, cols], y.device()))
    }

    fn matmul_grouped_batches(&self) -> bool {
        true
    }

    fn matmul(
        &self,
        a: &Tensor,
        la: MatLayout,
        b: &Tensor,
        lb: MatLayout,
        dims: MatDims,
    ) -> Result<Tensor> {
        let mut out = Out::for_overwrite(a.device(), dims.batch * dims.m * dims.n)?;
        matmul::matmul(&mut out.data, data(a), la, data(b), lb, dims);
        Ok(out.into_tensor(&[dims.batch, dims.m, dims.n], a.device()))
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
        let dev = x.device();
        let (ay, am, ar) = (
            Storage::reserve(dev, rows * cols)?,
            Storage::reserve(dev, rows)?,
            Storage::reserve(dev, rows)?,
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
            Out { data: y, alloc: ay }.into_tensor(&[rows, cols], dev),
            Out {
                data: mean,
                alloc: am,
            }
            .into_tensor(&[rows], dev),
            Out {
                data: rstd,
                alloc: ar,
            }
            .into_tensor(&[rows], dev),
        ))
    }

    fn cross_entropy_rows(
        &self,
        x: &Tensor,
        targets: &Tensor,
        rows: usize,
        cols: usize,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        debug_assert_eq!(x.numel(), rows * cols);
        let dev = x.device();
        let mut loss = Out::for_overwrite(dev, rows)?;
        let mut max = Out::for_overwrite(dev, rows)?;
        let mut logsum = Out::for_overwrite(dev, rows)?;
        cross_entropy::cross_entropy_rows(
            &mut loss.data,
            &mut max.data,
            &mut logsum.data,
            &contig(x),
            &contig(targets),
        );
        Ok((
            loss.into_tensor(&[rows], dev),
            max.into_tensor(&[rows], dev),
            logsum.into_tensor(&[rows], dev),
        ))
    }

    fn cross_entropy_backward_rows(
        &self,
        x: &Tensor,
        targets: &Tensor,
        max: &Tensor,
        logsum: &Tensor,
        g: &Tensor,
        rows: usize,
        cols: usize,
    ) -> Result<Tensor> {
        let mut out = Out::for_overwrite(x.device(), rows * cols)?;
        cross_entropy::cross_entropy_backward_rows(
            &mut out.data,
            &contig(x),
            &contig(targets),
            &contig(max),
            &contig(logsum),
            &contig(g),
        );
        Ok(out.into_tensor(&[rows, cols], x.device()))
    }

    fn add_layer_norm_rows(
        &self,
        x: &Tensor,
        r: &Tensor,
        gamma: &Tensor,
        beta: &Tensor,
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        let dev = x.device();
        let mut s = Out::for_overwrite(dev, rows * cols)?;
        let mut y = Out::for_overwrite(dev, rows * cols)?;
        let mut mean = Out::for_overwrite(dev, rows)?;
        let mut rstd = Out::for_overwrite(dev, rows)?;
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
            s.into_tensor(&[rows, cols], dev),
            y.into_tensor(&[rows, cols], dev),
            mean.into_tensor(&[rows], dev),
            rstd.into_tensor(&[rows], dev),
        ))
    }

    fn layer_norm_backward_rows(
        &self,
        x: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        gamma: &Tensor,
        g: &Tensor,
        carry: Option<&Tensor>,
        rows: usize,
        cols: usize,
    ) -> Result<Tensor> {
        let mut out = Out::for_overwrite(x.device(), rows * cols)?;
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
        Ok(out.into_tensor(&[rows, cols], x.device()))
    }

    fn index_select(
        &self,
        x: &Tensor,
        idx: &Tensor,
        outer: usize,
        dim: usize,
        inner: usize,
    ) -> Result<Tensor> {
        let n = idx.numel();
        let mut out = Out::for_overwrite(x.device(), outer * n * inner)?;
        index::index_select(&mut out.data, &contig(x), &contig(idx), dim, inner);
        Ok(out.into_tensor(&[outer, n, inner], x.device()))
    }

    fn index_add(
        &self,
        src: &Tensor,
        idx: &Tensor,
        outer: usize,
        dim: usize,
        inner: usize,
    ) -> Result<Tensor> {
        let mut out = Out::zeros(src.device(), outer * dim * inner)?;
        index::index_add(&mut out.data, &contig(src), &contig(idx), dim, inner);
        Ok(out.into_tensor(&[outer, dim, inner], src.device()))
    }

    fn gather(
        &self,
        x: &Tensor,
        idx: &Tensor,
        outer: usize,
        dim: usize,
        inner: usize,
    ) -> Result<Tensor> {
        let n = idx.numel().checked_div(outer * inner).unwrap_or(0);
        let mut out = Out::for_overwrite(x.device(), outer * n * inner)?;
        index::gather(&mut out.data, &contig(x), &contig(idx), n, dim, inner);
        Ok(out.into_tensor(&[outer, n, inner], x.device()))
    }

    fn scatter_add(
        &self,
        src: &Tensor,
        idx: &Tensor,
        outer: usize,
        dim: usize,
        inner: usize,
    ) -> Result<Tensor> {
        let n = idx.numel().checked_div(outer * inner).unwrap_or(0);
        let mut out = Out::zeros(src.device(), outer * dim * inner)?;
        index::scatter_add(&mut out.data, &contig(src), &contig(idx), n, dim, inner);
        Ok(out.into_tensor(&[outer, dim, inner], src.device()))
    }

    fn concat(&self, xs: &[&Tensor], axis: usize, out_shape: &[usize]) -> Result<Tensor> {
        let dev = xs[0].device();
        let mut out = Out::for_overwrite(dev, numel(out_shape))?;
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
        Ok(out.into_tensor(out_shape, dev))
    }

    fn im2col(&self, x: &Tensor, g: &Conv2dGeometry) -> Result<Tensor> {
        let (rows, cols) = (g.col_rows(), g.col_cols());
        let mut out = Out::for_overwrite(x.device(), g.n * g.groups * rows * cols)?;
        conv::im2col(&mut out.data, &contig(x), g);
        Ok(out.into_tensor(&[g.n, g.groups, rows, cols], x.device()))
    }

    fn col2im(&self, cols: &Tensor, g: &Conv2dGeometry) -> Result<Tensor> {
        let mut out = Out::zeros(cols.device(), g.n * g.c_in * g.h * g.w)?;
        conv::col2im(&mut out.data, &contig(cols), g);
        Ok(out.into_tensor(&[g.n, g.c_in, g.h, g.w], cols.device()))
    }

    fn max_pool2d(&self, x: &Tensor, g: &Pool2dGeometry) -> Result<(Tensor, Tensor)> {
        let dev = x.device();
        let n = g.n * g.c * g.h_out * g.w_out;
        let (ay, aa) = (Storage::reserve(dev, n)?, Storage::reserve(dev, n)?);
        let (mut y, mut am) = (
            host_pool::take_for_overwrite(n),
            host_pool::take_for_overwrite(n),
        );
        pool::max_pool2d(&mut y, &mut am, &contig(x), g);
        let shape = [g.n, g.c, g.h_out, g.w_out];
        Ok((
            Out { data: y, alloc: ay }.into_tensor(&shape, dev),
            Out {
                data: am,
                alloc: aa,
            }
            .into_tensor(&shape, dev),
        ))
    }

    fn max_pool2d_backward(
        &self,
        dy: &Tensor,
        argmax: &Tensor,
        g: &Pool2dGeometry,
    ) -> Result<Tensor> {
        let mut out = Out::zeros(dy.device(), g.n * g.c * g.h * g.w)?;
        pool::max_pool2d_backward(&mut out.data, &contig(dy), &contig(argmax), g);
        Ok(out.into_tensor(&[g.n, g.c, g.h, g.w], dy.device()))
    }

    fn avg_pool2d(&self, x: &Tensor, g: &Pool2dGeometry) -> Result<Tensor> {
        let mut out = Out::for_overwrite(x.device(), g.n * g.c * g.h_out * g.w_out)?;
        pool::avg_pool2d(&mut out.data, &contig(x), g);
        Ok(out.into_tensor(&[g.n, g.c, g.h_out, g.w_out], x.device()))
    }

    fn avg_pool2d_backward(&self, dy: &Tensor, g: &Pool2dGeometry) -> Result<Tensor> {
        let mut out = Out::zeros(dy.device(), g.n * g.c * g.h * g.w)?;
        pool::avg_pool2d_backward(&mut out.data, &contig(dy), g);
        Ok(out.into_tensor(&[g.n, g.c, g.h, g.w], dy.device()))
    }

    fn dropout_mask(
        &self,
        dev: &Device,
        shape: &[usize],
        p: f32,
        seed: u64,
        offset: u64,
    ) -> Result<Tensor> {
        let mut out = Out::for_overwrite(dev, numel(shape))?;
        random::dropout_mask(&mut out.data, p, seed, offset);
        Ok(out.into_tensor(shape, dev))
    }

    fn adam_update(
        &self,
        param: &Tensor,
        grad: &Tensor,
        m: &Tensor,
        v: &Tensor,
        hp: &AdamStep,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let dev = param.device();
        let n = param.numel();
        let (ap, am, av) = (
            Storage::reserve(dev, n)?,
            Storage::reserve(dev, n)?,
            Storage::reserve(dev, n)?,
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
            .into_tensor(shape, dev),
            Out {
                data: m2,
                alloc: am,
            }
            .into_tensor(shape, dev),
            Out {
                data: v2,
                alloc: av,
            }
            .into_tensor(shape, dev),
        ))
    }

    fn adam_update_in_place(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        m: &mut Tensor,
        v: &mut Tensor,
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
