//! Elementwise ops: binary with numpy broadcasting (gradients summed back to each input's shape),
//! scalar arithmetic, `where_cond` and `masked_fill`. The unary ops are in `unary.rs`.

use wgpipe_tensor::{Result, Tensor};

use super::{same_tape, when, zero_scalar};
use crate::var::Var;

/// Sums a broadcast gradient back to `shape` (no work when it already has it).
fn reduce_to(g: Tensor, shape: &[usize]) -> Result<Tensor> {
    if g.shape() == shape {
        Ok(g)
    } else {
        g.sum_to_shape(shape)
    }
}

/// Records a binary op; `bwd` gives the (broadcast-shaped) gradients of `a` and `b`.
fn binary(
    op: &'static str,
    a: &Var,
    b: &Var,
    y: Tensor,
    bwd: impl FnMut(&Tensor, &[bool]) -> Result<(Option<Tensor>, Option<Tensor>)> + 'static,
) -> Result<Var> {
    let (sa, sb) = (a.shape().to_vec(), b.shape().to_vec());
    let mut bwd = bwd;
    Var::from_op(op, &[a, b], y, move |g, w| {
        let (ga, gb) = bwd(g, w)?;
        Ok(vec![
            ga.map(|t| reduce_to(t, &sa)).transpose()?,
            gb.map(|t| reduce_to(t, &sb)).transpose()?,
        ])
    })
}

/// Records a unary op with gradient `bwd(g)`.
fn unary(
    op: &'static str,
    x: &Var,
    y: Tensor,
    bwd: impl FnMut(&Tensor) -> Result<Tensor> + 'static,
) -> Result<Var> {
    let mut bwd = bwd;
    Var::from_op(op, &[x], y, move |g, _| Ok(vec![Some(bwd(g)?)]))
}

impl Var {
    pub fn add(&self, other: &Var) -> Result<Var> {
        same_tape("add", &[self, other])?;
        let y = self.value.add(&other.value)?;
        binary("add", self, other, y, |g, w| {
            Ok((w[0].then(|| g.clone()), w[1].then(|| g.clone())))
        })
    }

    pub fn sub(&self, other: &Var) -> Result<Var> {
        same_tape("sub", &[self, other])?;
        let y = self.value.sub(&other.value)?;
        binary("sub", self, other, y, |g, w| {
            Ok((w[0].then(|| g.clone()), when(w[1], || g.neg())?))
        })
    }

    pub fn mul(&self, other: &Var) -> Result<Var> {
        same_tape("mul", &[self, other])?;
        let y = self.value.mul(&other.value)?;
        let (a, b) = (
            other.requires_grad.then(|| self.value.clone()),
            self.requires_grad.then(|| other.value.clone()),
        );
        binary("mul", self, other, y, move |g, w| {
            Ok((
                when(w[0], || g.mul(b.as_ref().unwrap()))?,
                when(w[1], || g.mul(a.as_ref().unwrap()))?,
            ))
        })
    }

    pub fn div(&self, other: &Var) -> Result<Var> {
        same_tape("div", &[self, other])?;
        let y = self.value.div(&other.value)?;
        let b = other.value.clone();
        let yy = other.requires_grad.then(|| y.clone());
        binary("div", self, other, y, move |g, w| {
            // d(a/b)/da = 1/b, d(a/b)/db = -a/b^2 = -y/b
            Ok((
                when(w[0], || g.div(&b))?,
                when(w[1], || g.mul(yy.as_ref().unwrap())?.div(&b)?.neg())?,
            ))
        })
    }

    /// Elementwise maximum; at ties the gradient goes to `self`.
    pub fn maximum(&self, other: &Var) -> Result<Var> {
        same_tape("maximum", &[self, other])?;
        let y = self.value.maximum(&other.value)?;
        let (a, b) = (self.value.clone(), other.value.clone());
        binary("maximum", self, other, y, move |g, w| {
            let ga = g.mul(&a.ge(&b)?)?;
            let gb = when(w[1], || g.sub(&ga))?;
            Ok((w[0].then_some(ga), gb))
        })
    }

    /// Elementwise minimum; at ties the gradient goes to `self`.
    pub fn minimum(&self, other: &Var) -> Result<Var> {
        same_tape("minimum", &[self, other])?;
        let y = self.value.minimum(&other.value)?;
        let (a, b) = (self.value.clone(), other.value.clone());
        binary("minimum", self, other, y, move |g, w| {
            let ga = g.mul(&a.le(&b)?)?;
            let gb = when(w[1], || g.sub(&ga))?;
            Ok((w[0].then_some(ga), gb))
        })
    }

    /// `self ^ other` elementwise (the gradient wrt the exponent needs `self > 0`).
    pub fn pow(&self, other: &Var) -> Result<Var> {
        same_tape("pow", &[self, other])?;
        let y = self.value.pow(&other.value)?;
        let (a, b, yy) = (self.value.clone(), other.value.clone(), y.clone());
        binary("pow", self, other, y, move |g, w| {
            // d/da = b a^(b-1), d/db = y ln a
            Ok((
                when(w[0], || g.mul(&b)?.mul(&a.pow(&b.sub_scalar(1.0)?)?))?,
                when(w[1], || g.mul(&yy)?.mul(&a.log()?))?,
            ))
        })
    }

    pub fn add_scalar(&self, s: f32) -> Result<Var> {
        let y = self.value.add_scalar(s)?;
        unary("add_scalar", self, y, |g| Ok(g.clone()))
    }

    pub fn sub_scalar(&self, s: f32) -> Result<Var> {
        let y = self.value.sub_scalar(s)?;
        unary("sub_scalar", self, y, |g| Ok(g.clone()))
    }

    pub fn mul_scalar(&self, s: f32) -> Result<Var> {
        let y = self.value.mul_scalar(s)?;
        unary("mul_scalar", self, y, move |g| g.mul_scalar(s))
    }

    pub fn div_scalar(&self, s: f32) -> Result<Var> {
        let y = self.value.div_scalar(s)?;
        unary("div_scalar", self, y, move |g| g.div_scalar(s))
    }

    /// `value` where `mask != 0`, else `self` (mask broadcasts to `self`); no gradient flows
    /// through the filled places.
    pub fn masked_fill(&self, mask: &Tensor, value: f32) -> Result<Var> {
        let y = self.value.masked_fill(mask, value)?;
        let (m, shape) = (mask.clone(), self.shape().to_vec());
        unary("masked_fill", self, y, move |g| {
            reduce_to(g.masked_fill(&m, 0.0)?, &shape)
        })
    }

    /// `cond != 0 ? a : b`, the three broadcast together.
    pub fn where_cond(cond: &Tensor, a: &Var, b: &Var) -> Result<Var> {
        same_tape("where_cond", &[a, b])?;
        let y = Tensor::where_cond(cond, &a.value, &b.value)?;
        let c = cond.clone();
        binary("where_cond", a, b, y, move |g, w| {
            let z = zero_scalar(g)?;
            Ok((
                when(w[0], || Tensor::where_cond(&c, g, &z))?,
                when(w[1], || Tensor::where_cond(&c, &z, g))?,
            ))
        })
    }
}
