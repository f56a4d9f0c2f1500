//! Reductions over axes (empty `axes` = all), with or without `keepdim`.

use wgpipe_tensor::Result;

use super::{keep_shape, resolve_axes, unreduce};
use crate::var::Var;

impl Var {
    pub fn sum(&self, axes: &[isize], keepdim: bool) -> Result<Var> {
        let y = self.value.sum(axes, keepdim)?;
        let ax = resolve_axes("sum", axes, self.rank())?;
        let shape = self.shape().to_vec();
        Var::from_op("sum", &[self], y, move |g, _| {
            Ok(vec![Some(unreduce(g, &shape, &ax)?)])
        })
    }

    pub fn mean(&self, axes: &[isize], keepdim: bool) -> Result<Var> {
        let y = self.value.mean(axes, keepdim)?;
        let ax = resolve_axes("mean", axes, self.rank())?;
        let shape = self.shape().to_vec();
        let n: usize = ax.iter().map(|&a| shape[a]).product();
        Var::from_op("mean", &[self], y, move |g, _| {
            let g = g.div_scalar(n.max(1) as f32)?;
            Ok(vec![Some(unreduce(&g, &shape, &ax)?)])
        })
    }

    /// Sum of every element (a 0-d var).
    pub fn sum_all(&self) -> Result<Var> {
        self.sum(&[], false)
    }

    /// Mean of every element (a 0-d var).
    pub fn mean_all(&self) -> Result<Var> {
        self.mean(&[], false)
    }

    /// Maximum over `axes`; ties share the gradient equally.
    pub fn max(&self, axes: &[isize], keepdim: bool) -> Result<Var> {
        self.extreme("max", axes, keepdim)
    }

    /// Minimum over `axes`; ties share the gradient equally.
    pub fn min(&self, axes: &[isize], keepdim: bool) -> Result<Var> {
        self.extreme("min", axes, keepdim)
    }

    fn extreme(&self, op: &'static str, axes: &[isize], keepdim: bool) -> Result<Var> {
        let y = if op == "max" {
            self.value.max(axes, keepdim)?
        } else {
            self.value.min(axes, keepdim)?
        };
        let ax = resolve_axes(op, axes, self.rank())?;
        let (x, yy, shape) = (self.value.clone(), y.clone(), self.shape().to_vec());
        Var::from_op(op, &[self], y, move |g, _| {
            let hit = x.eq(&unreduce(&yy, &shape, &ax)?)?;
            let count = hit.sum(&ax.iter().map(|&a| a as isize).collect::<Vec<_>>(), true)?;
            let share = g.reshape(&keep_shape(&shape, &ax))?.div(&count)?;
            Ok(vec![Some(hit.mul(&share)?)])
        })
    }

    /// Population variance (divisor n) over `axes`.
    pub fn var(&self, axes: &[isize], keepdim: bool) -> Result<Var> {
        let y = self.value.var(axes, keepdim)?;
        let ax = resolve_axes("var", axes, self.rank())?;
        let (x, shape) = (self.value.clone(), self.shape().to_vec());
        let n: usize = ax.iter().map(|&a| shape[a]).product();
        Var::from_op("var", &[self], y, move |g, _| {
            // d var / dx = 2 (x - mean) / n
            let iax: Vec<isize> = ax.iter().map(|&a| a as isize).collect();
            let centered = x.sub(&x.mean(&iax, true)?)?;
            let g = g
                .reshape(&keep_shape(&shape, &ax))?
                .mul_scalar(2.0 / n.max(1) as f32)?;
            Ok(vec![Some(centered.mul(&g)?)])
        })
    }
}
