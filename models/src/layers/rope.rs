//! Rotary position embedding as transformers computes it (`LlamaRotaryEmbedding`,
//! `apply_rotary_pos_emb`): the rotate-half form, where element `i` of a head pairs with element
//! `i + d/2`, the inverse frequencies `1 / theta^(2i/d)` in f32, and the `rope_scaling` types
//! `default`, `linear` and `llama3`.

use wgpipe_autograd::Var;
use wgpipe_tensor::{Device, Result, Tensor};

use super::{invalid, shape_error};

/// How the inverse frequencies are scaled (transformers' `rope_type`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// The original RoPE.
    Default,
    /// Positions divided by `factor` (every frequency divided by it).
    Linear { factor: f32 },
    /// Llama 3.1's: wavelengths longer than `original_max_position_embeddings /
    /// low_freq_factor` divided by `factor`, shorter than `.. / high_freq_factor` kept, those in
    /// between interpolated.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: usize,
    },
}

/// The rotary embedding of heads of `head_dim` values.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    head_dim: usize,
    /// `head_dim / 2` inverse frequencies, in f32 as transformers keeps them.
    inv_freq: Vec<f32>,
}

impl Rope {
    /// The embedding of `head_dim` (even) values a head, base `theta`, scaled as `scaling` says.
    pub fn new(head_dim: usize, theta: f32, scaling: RopeScaling) -> Result<Rope> {
        let bad = |msg: String| invalid("Rope", msg);
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(bad(format!(
                "head_dim must be even and positive for the rotate-half form, got {head_dim}"
            )));
        }
        if !(theta.is_finite() && theta > 1.0) {
            return Err(bad(format!(
                "rope_theta must be finite and > 1, got {theta}"
            )));
        }
        // transformers: 1.0 / (base ** (arange(0, dim, 2).float() / dim)), every step in f32.
        let d = head_dim as f32;
        let mut inv_freq: Vec<f32> = (0..head_dim / 2)
            .map(|i| 1.0 / theta.powf((2 * i) as f32 / d))
            .collect();
        match scaling {
            RopeScaling::Default => {}
            RopeScaling::Linear { factor } => {
                if !(factor.is_finite() && factor > 0.0) {
                    return Err(bad(format!(
                        "linear rope_scaling factor must be > 0, got {factor}"
                    )));
                }
                for f in &mut inv_freq {
                    *f /= factor;
                }
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                if !(factor > 0.0 && low_freq_factor > 0.0 && high_freq_factor > low_freq_factor)
                    || original_max_position_embeddings == 0
                {
                    return Err(bad(format!(
                        "llama3 rope_scaling needs factor > 0, 0 < low_freq_factor < \
                         high_freq_factor and original_max_position_embeddings > 0, got factor \
                         {factor}, low_freq_factor {low_freq_factor}, high_freq_factor \
                         {high_freq_factor}, original_max_position_embeddings \
                         {original_max_position_embeddings}"
                    )));
                }
                let old = original_max_position_embeddings as f32;
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                for f in &mut inv_freq {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    let scaled = if wavelen > low_wavelen {
                        *f / factor
                    } else {
                        *f
                    };
                    let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                    *f = if medium {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * scaled / factor + smooth * scaled
                    } else {
                        scaled
                    };
                }
            }
        }
        Ok(Rope { head_dim, inv_freq })
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The inverse frequencies (`head_dim / 2` of them).
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// `(cos, sin)`, each `[t, head_dim]` f32, for positions `start .. start + t`: the angle of
    /// position `p` and pair `i` is `p * inv_freq[i]` (one f32 product), repeated for both
    /// halves of the head (`cat(freqs, freqs)`).
    pub fn tables(&self, start: usize, t: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
        let half = self.head_dim / 2;
        let mut cos = Vec::with_capacity(t * self.head_dim);
        let mut sin = Vec::with_capacity(t * self.head_dim);
        for p in start..start + t {
            for j in 0..self.head_dim {
                let angle = (p as f32 * self.inv_freq[j % half]) as f64;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        let shape = [t, self.head_dim];
        Ok((
            Tensor::from_vec(cos, &shape, dev)?,
            Tensor::from_vec(sin, &shape, dev)?,
        ))
    }

    /// `x * cos + rotate_half(x) * sin` for `x` of `[.., t, head_dim]` at positions `start ..
    /// start + t`, in `x`'s dtype (the tables rounded to it, as transformers casts them to the
    /// query's dtype); `rotate_half(x) = cat(-x[.., d/2..], x[.., ..d/2])`.
    pub fn apply(&self, x: &Var, start: usize) -> Result<Var> {
        let shape = x.shape();
        let r = shape.len();
        if r < 2 || shape[r - 1] != self.head_dim {
            return Err(shape_error(
                "Rope",
                format!(
                    "input {shape:?} must be [.., t, head_dim = {}]",
                    self.head_dim
                ),
            ));
        }
        let (t, half) = (shape[r - 2], self.head_dim / 2);
        let dtype = x.value().dtype();
        let (cos, sin) = self.tables(start, t, x.device())?;
        let tape = x.tape();
        let (cos, sin) = (
            tape.constant(cos.to_dtype(dtype)?),
            tape.constant(sin.to_dtype(dtype)?),
        );
        let x1 = x.narrow(-1, 0, half)?;
        let x2 = x.narrow(-1, half, half)?;
        let rotated = Var::concat(&[&x2.neg()?, &x1], -1)?;
        x.mul(&cos)?.add(&rotated.mul(&sin)?)
    }
}
