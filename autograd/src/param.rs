//! `Param`: a named, trainable tensor with its accumulated gradient.
//!
//! Shared handle (`Arc<Mutex<..>>`): a module owns its params, the tape refers to them while
//! recording, the optimizer updates them. Gradients accumulate across backward calls (one per
//! micro-batch) until `zero_grad`.

use std::sync::{Arc, Mutex, MutexGuard};

use wgpipe_tensor::{DType, Device, Result, Tag, Tensor};

#[derive(Clone)]
pub struct Param {
    inner: Arc<Mutex<ParamInner>>,
}

struct ParamInner {
    name: String,
    value: Tensor,
    grad: Option<Tensor>,
    trainable: bool,
    /// The tie group: copies of one parameter used in several places (see [`tied`](super::tied)).
    tie: Option<String>,
    /// The value cast to a compute dtype (see [`Param::value_in`]); dropped whenever `value`
    /// changes, so it can never be stale.
    cast: Option<Tensor>,
}

impl Param {
    /// A trainable parameter; its bytes are accounted as `Tag::Parameters`.
    pub fn new(name: impl Into<String>, value: Tensor) -> Param {
        value.retag(Tag::Parameters);
        Param {
            inner: Arc::new(Mutex::new(ParamInner {
                name: name.into(),
                value,
                grad: None,
                trainable: true,
                tie: None,
                cast: None,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, ParamInner> {
        // A panic in another thread while holding the lock leaves consistent data (every write
        // is a single assignment), so a poisoned lock is safe to use.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn name(&self) -> String {
        self.lock().name.clone()
    }
    pub fn set_name(&self, name: impl Into<String>) {
        self.lock().name = name.into();
    }
    pub fn value(&self) -> Tensor {
        self.lock().value.clone()
    }
    pub fn shape(&self) -> Vec<usize> {
        self.lock().value.shape().to_vec()
    }
    pub fn device(&self) -> Device {
        self.lock().value.device().clone()
    }
    /// Replaces the value (optimizer step, load). The new tensor is accounted as a parameter.
    pub fn set_value(&self, value: Tensor) {
        value.retag(Tag::Parameters);
        let mut inner = self.lock();
        inner.value = value;
        inner.cast = None;
    }
    /// The value in `dtype`: the value itself when it has that dtype, else a copy cast to it
    /// (autocast's half copy of an f32 master weight). The copy is made once and kept until the
    /// value changes (`set_value`: optimizer step, load, tie sync; `to_device`), so every
    /// micro-batch of a step shares one copy instead of casting (and keeping for its backward)
    /// its own. It is accounted as a parameter.
    pub fn value_in(&self, dtype: DType) -> Result<Tensor> {
        let mut inner = self.lock();
        if inner.value.dtype() == dtype {
            return Ok(inner.value.clone());
        }
        if let Some(c) = inner.cast.as_ref().filter(|c| c.dtype() == dtype) {
            return Ok(c.clone());
        }
        let c = inner.value.to_dtype(dtype)?;
        c.retag(Tag::Parameters);
        inner.cast = Some(c.clone());
        Ok(c)
    }
    pub fn grad(&self) -> Option<Tensor> {
        self.lock().grad.clone()
    }
    pub fn set_grad(&self, grad: Option<Tensor>) {
        if let Some(g) = &grad {
            g.retag(Tag::Gradients);
        }
        self.lock().grad = grad;
    }
    /// Adds `g` to the accumulated gradient (the first call stores it). Out of place on purpose:
    /// the planner's memory model (`pipeline::plan::profile`) prices this sum as a new buffer,
    /// and an in-place sum here made its predicted peaks fall below the measured ones.
    pub fn accumulate_grad(&self, g: &Tensor) -> Result<()> {
        let mut inner = self.lock();
        let sum = match &inner.grad {
            Some(old) => old.add(g)?,
            None => g.contiguous()?,
        };
        sum.retag(Tag::Gradients);
        inner.grad = Some(sum);
        Ok(())
    }
    /// True when the value could be updated in place: nothing but this parameter holds its
    /// memory ([`Tensor::is_exclusive`]; a clone taken with [`Param::value`] makes it false).
    pub fn value_is_exclusive(&self) -> bool {
        self.lock().value.is_exclusive()
    }
    /// Runs `f` on the value under the parameter's lock (an optimizer's in-place update); the
    /// value, replaced or not, is accounted as a parameter afterwards, and its cached compute
    /// copy is dropped (an in-place write changes the value as `set_value` does).
    pub fn update_value<R>(&self, f: impl FnOnce(&mut Tensor) -> R) -> R {
        let mut inner = self.lock();
        let r = f(&mut inner.value);
        inner.value.retag(Tag::Parameters);
        inner.cast = None;
        r
    }
    pub fn zero_grad(&self) {
        self.lock().grad = None;
    }
    /// Frozen params get no gradient (fine-tuning with a frozen body).
    pub fn set_trainable(&self, trainable: bool) {
        self.lock().trainable = trainable;
    }
    pub fn is_trainable(&self) -> bool {
        self.lock().trainable
    }
    /// Moves the value (and gradient) to `device`.
    pub fn to_device(&self, device: &Device) -> Result<()> {
        let mut inner = self.lock();
        let v = wgpipe_tensor::memory::with_tag(Tag::Parameters, || inner.value.to_device(device))?;
        inner.value = v;
        inner.cast = None;
        if let Some(g) = inner.grad.take() {
            inner.grad = Some(wgpipe_tensor::memory::with_tag(Tag::Gradients, || {
                g.to_device(device)
            })?);
        }
        Ok(())
    }
    /// The tie group of this parameter, if it is a tied copy (see [`tied`](super::tied)).
    pub fn tie_group(&self) -> Option<String> {
        self.lock().tie.clone()
    }
    /// Makes this parameter a copy in tie group `group`.
    pub fn set_tie_group(&self, group: impl Into<String>) {
        self.lock().tie = Some(group.into());
    }
    /// A new parameter named `name` holding a copy of this one's value (its own memory, so it
    /// can live on another device), tied to this one in group `group` (which this one joins).
    pub fn tied_copy(&self, name: impl Into<String>, group: &str) -> Result<Param> {
        self.set_tie_group(group);
        let v = self.value();
        let copy = Param::new(name, Tensor::from_vec(v.to_vec()?, v.shape(), v.device())?);
        copy.set_tie_group(group);
        copy.set_trainable(self.is_trainable());
        Ok(copy)
    }
    /// True when both handles are the same parameter.
    pub fn same(&self, other: &Param) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl std::fmt::Debug for Param {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let i = self.lock();
        write!(f, "Param({}, {:?})", i.name, i.value.shape())
    }
}
