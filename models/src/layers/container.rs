//! Containers: `Sequential` (named children run in order) and `Residual`
//! (`post(body(x) + shortcut(x))`, the shortcut being the identity when absent).

use wgpipe_autograd::{CostHint, ForwardCtx, Module, Param, Var};
use wgpipe_tensor::Result;

use super::prefix;
use super::transformer::chain;

/// Children run one after the other; a child named `conv` has parameters `conv.*`.
#[derive(Default)]
pub struct Sequential {
    label: String,
    children: Vec<(String, Box<dyn Module>)>,
}

impl Sequential {
    /// An empty sequence reported as `label`.
    pub fn new(label: impl Into<String>) -> Self {
        Sequential {
            label: label.into(),
            children: Vec::new(),
        }
    }
    /// Appends a child (builder style).
    pub fn with(mut self, name: impl Into<String>, m: impl Module + 'static) -> Self {
        self.push(name, Box::new(m));
        self
    }
    pub fn push(&mut self, name: impl Into<String>, m: Box<dyn Module>) {
        self.children.push((name.into(), m));
    }
    pub fn len(&self) -> usize {
        self.children.len()
    }
    pub fn is_empty(&self) -> bool {
        self.children.is_empty()
    }
    pub fn children(&self) -> &[(String, Box<dyn Module>)] {
        &self.children
    }
}

impl Module for Sequential {
    fn name(&self) -> String {
        if !self.label.is_empty() {
            return self.label.clone();
        }
        let inner: Vec<String> = self.children.iter().map(|(_, m)| m.name()).collect();
        format!("Sequential[{}]", inner.join(", "))
    }
    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let mut h = x.clone();
        for (_, m) in &self.children {
            h = m.forward(&h, ctx)?;
        }
        Ok(h)
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        self.children
            .iter()
            .flat_map(|(n, m)| prefix(n, m.parameters()))
            .collect()
    }
    fn buffers(&self) -> Vec<(String, Param)> {
        self.children
            .iter()
            .flat_map(|(n, m)| prefix(n, m.buffers()))
            .collect()
    }
    fn set_train(&mut self, train: bool) {
        for (_, m) in &mut self.children {
            m.set_train(train);
        }
    }
    fn finish_step(&self) -> Result<()> {
        self.children.iter().try_for_each(|(_, m)| m.finish_step())
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        let mods: Vec<&dyn Module> = self.children.iter().map(|(_, m)| m.as_ref()).collect();
        chain(&mods, input_shape)
    }
}

/// `post(body(x) + shortcut(x))`: parameters `body.*`, `shortcut.*`, `post.*`.
pub struct Residual {
    pub body: Box<dyn Module>,
    pub shortcut: Option<Box<dyn Module>>,
    pub post: Option<Box<dyn Module>>,
}

impl Residual {
    /// `x + body(x)`.
    pub fn new(body: impl Module + 'static) -> Self {
        Residual {
            body: Box::new(body),
            shortcut: None,
            post: None,
        }
    }
    /// A shortcut other than the identity (e.g. a strided 1x1 convolution).
    pub fn with_shortcut(mut self, s: impl Module + 'static) -> Self {
        self.shortcut = Some(Box::new(s));
        self
    }
    /// A layer after the addition (e.g. ReLU).
    pub fn with_post(mut self, p: impl Module + 'static) -> Self {
        self.post = Some(Box::new(p));
        self
    }
    fn parts(&self) -> impl Iterator<Item = (&'static str, &dyn Module)> {
        std::iter::once(("body", self.body.as_ref()))
            .chain(self.shortcut.as_deref().map(|m| ("shortcut", m)))
            .chain(self.post.as_deref().map(|m| ("post", m)))
    }
}

impl Module for Residual {
    fn name(&self) -> String {
        format!("Residual({})", self.body.name())
    }
    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let y = self.body.forward(x, ctx)?;
        let s = match &self.shortcut {
            Some(m) => m.forward(x, ctx)?,
            None => x.clone(),
        };
        let y = y.add(&s)?;
        match &self.post {
            Some(p) => p.forward(&y, ctx),
            None => Ok(y),
        }
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        self.parts()
            .flat_map(|(n, m)| prefix(n, m.parameters()))
            .collect()
    }
    fn buffers(&self) -> Vec<(String, Param)> {
        self.parts()
            .flat_map(|(n, m)| prefix(n, m.buffers()))
            .collect()
    }
    fn set_train(&mut self, train: bool) {
        self.body.set_train(train);
        if let Some(m) = &mut self.shortcut {
            m.set_train(train);
        }
        if let Some(m) = &mut self.post {
            m.set_train(train);
        }
    }
    fn finish_step(&self) -> Result<()> {
        self.parts().try_for_each(|(_, m)| m.finish_step())
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        let b = self.body.cost(input_shape);
        let mut total = b.clone();
        if let Some(s) = &self.shortcut {
            let c = s.cost(input_shape);
            total.param_bytes += c.param_bytes;
            total.flops += c.flops;
            total.activation_bytes += c.activation_bytes;
        }
        total.flops += b.output_shape.iter().product::<usize>() as f64;
        if let Some(p) = &self.post {
            let c = p.cost(&b.output_shape);
            total.param_bytes += c.param_bytes;
            total.flops += c.flops;
            total.activation_bytes += c.activation_bytes;
            total.output_shape = c.output_shape;
        }
        total
    }
}
