//! A test layer with skips and a model made of it.

use super::*;

/// A test layer with skips: `y = x + Σ popped`, and each stash either `x` itself (`None`: the
/// identity, so a stage may stash its own input or hand on the same var as its output) or
/// `linear(x)` (so the producer's parameters get gradient only through the skip).
pub struct SkipLayer {
    pops: Vec<String>,
    stashes: Vec<(String, Option<Linear>)>,
}

impl SkipLayer {
    pub fn new() -> SkipLayer {
        SkipLayer {
            pops: Vec::new(),
            stashes: Vec::new(),
        }
    }
    pub fn pop(mut self, name: &str) -> SkipLayer {
        self.pops.push(name.into());
        self
    }
    /// Stashes `x` as it is.
    pub fn stash(mut self, name: &str) -> SkipLayer {
        self.stashes.push((name.into(), None));
        self
    }
    /// Stashes `linear(x)` (width to width).
    pub fn stash_linear(mut self, name: &str, width: usize, seed: u64) -> SkipLayer {
        let l = Linear::new(width, width, seed, &Device::cpu()).unwrap();
        self.stashes.push((name.into(), Some(l)));
        self
    }
}

impl Default for SkipLayer {
    fn default() -> Self {
        SkipLayer::new()
    }
}

impl Module for SkipLayer {
    fn name(&self) -> String {
        let stashes: Vec<&str> = self.stashes.iter().map(|(n, _)| n.as_str()).collect();
        format!("Skip(pop {:?}, stash {:?})", self.pops, stashes)
    }
    fn forward(&self, x: &Var, _ctx: &ForwardCtx) -> Result<Var> {
        if self.pops.is_empty() && self.stashes.is_empty() {
            return Ok(x.clone());
        }
        Err(Error::Invalid {
            op: "SkipLayer",
            msg: "a layer with skips runs through forward_skips".into(),
        })
    }
    fn skips(&self) -> wgpipe_autograd::Skips {
        wgpipe_autograd::Skips {
            pops: self.pops.clone(),
            stashes: self.stashes.iter().map(|(n, _)| n.clone()).collect(),
        }
    }
    fn forward_skips(&self, x: &Var, popped: &[Var], ctx: &ForwardCtx) -> Result<(Var, Vec<Var>)> {
        let mut y = x.clone();
        for p in popped {
            y = y.add(p)?;
        }
        let stashed = self
            .stashes
            .iter()
            .map(|(_, l)| match l {
                Some(l) => l.forward(x, ctx),
                None => Ok(x.clone()),
            })
            .collect::<Result<Vec<Var>>>()?;
        Ok((y, stashed))
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        self.stashes
            .iter()
            .filter_map(|(n, l)| l.as_ref().map(|l| (n, l)))
            .flat_map(|(n, l)| {
                l.parameters()
                    .into_iter()
                    .map(move |(p, v)| (format!("{n}.{p}"), v))
            })
            .collect()
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        CostHint::pass_through(input_shape)
    }
}

/// A 9-layer model of width 6 (output 3) with three skips: `a` (layer 1 -> 4, `linear(x)`),
/// `b` (2 -> 7, the identity) and `c` (4 -> 6, `linear(x)`). Cut evenly into 4 stages they
/// span 1, 3 and 1 stages; into 3 stages 1, 2 and 1; into 8 stages 3, 5 and 2.
pub fn skip_model(seed: u64) -> Vec<Box<dyn Module>> {
    let d = Device::cpu();
    let w = 6;
    vec![
        Box::new(Linear::new(w, w, seed, &d).unwrap()),
        Box::new(SkipLayer::new().stash_linear("a", w, seed + 1)),
        Box::new(SkipLayer::new().stash("b")),
        Box::new(Linear::new(w, w, seed + 2, &d).unwrap()),
        Box::new(SkipLayer::new().pop("a").stash_linear("c", w, seed + 3)),
        Box::new(Linear::new(w, w, seed + 4, &d).unwrap()),
        Box::new(SkipLayer::new().pop("c")),
        Box::new(SkipLayer::new().pop("b")),
        Box::new(Linear::new(w, 3, seed + 5, &d).unwrap()),
    ]
}
