//! `#[derive(Module)]` against hand-written expectations: the names of parameters and buffers
//! for each kind of field, train mode and end-of-step calls reaching every child, and the
//! forward being the struct's own.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use wgpipe_autograd::{ForwardCtx, Module, Param, Tape, Var};
use wgpipe_tensor::{Device, Result, Tensor};

fn param(name: &str, v: f32) -> Param {
    Param::new(
        name,
        Tensor::from_vec(vec![v], &[1], &Device::cpu()).unwrap(),
    )
}

/// A child written by hand: counts `finish_step` calls and remembers its train mode.
struct Probe {
    w: Param,
    train: bool,
    finished: Arc<AtomicUsize>,
}

impl Module for Probe {
    fn forward(&self, x: &Var, _: &ForwardCtx) -> Result<Var> {
        x.mul(&x.param(&self.w)?)
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        vec![("w".into(), self.w.clone())]
    }
    fn buffers(&self) -> Vec<(String, Param)> {
        vec![("seen".into(), self.w.clone())]
    }
    fn set_train(&mut self, train: bool) {
        self.train = train;
    }
    fn finish_step(&self) -> Result<()> {
        self.finished.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// `x * scale * child(x) + Σ extra`, each kind of field once.
#[derive(Module)]
struct Every {
    scale: Param,
    bias: Option<Param>,
    missing: Option<Param>,
    extra: Vec<Param>,
    #[wgpipe(buffer)]
    running: Param,
    #[wgpipe(module)]
    child: Probe,
    #[wgpipe(module, rename = "self_attn")]
    attn: Option<Probe>,
    #[wgpipe(module)]
    blocks: Vec<Box<dyn Module>>,
    #[allow(dead_code)]
    width: usize,
}

impl Every {
    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let mut y = x
            .mul(&x.param(&self.scale)?)?
            .mul(&self.child.forward(x, ctx)?)?;
        for p in &self.extra {
            y = y.add(&x.param(p)?)?;
        }
        Ok(y)
    }
}

fn every(finished: &Arc<AtomicUsize>) -> Every {
    let probe = |v| Probe {
        w: param("w", v),
        train: false,
        finished: finished.clone(),
    };
    Every {
        scale: param("scale", 2.0),
        bias: Some(param("bias", 0.5)),
        missing: None,
        extra: vec![param("e", 1.0), param("e", 10.0)],
        running: param("running", 0.0),
        child: probe(3.0),
        attn: Some(probe(4.0)),
        blocks: vec![Box::new(probe(5.0)), Box::new(probe(6.0))],
        width: 1,
    }
}

#[test]
fn fields_become_named_parameters_and_buffers() {
    let finished = Arc::new(AtomicUsize::new(0));
    let m = every(&finished);
    assert!(m.missing.is_none());
    let names = |v: Vec<(String, Param)>| v.into_iter().map(|(n, _)| n).collect::<Vec<_>>();
    assert_eq!(
        names(m.parameters()),
        [
            "scale",
            "bias",
            "extra.0",
            "extra.1",
            "child.w",
            "self_attn.w",
            "blocks.0.w",
            "blocks.1.w"
        ]
    );
    assert_eq!(
        names(m.buffers()),
        [
            "running",
            "child.seen",
            "self_attn.seen",
            "blocks.0.seen",
            "blocks.1.seen"
        ]
    );
    assert_eq!(m.name(), "Every");
}

#[test]
fn train_mode_and_finish_step_reach_every_child() {
    let finished = Arc::new(AtomicUsize::new(0));
    let mut m = every(&finished);
    m.set_train(true);
    assert!(m.child.train && m.attn.as_ref().unwrap().train);
    m.finish_step().unwrap();
    // child, self_attn and the two blocks.
    assert_eq!(finished.load(Ordering::Relaxed), 4);
}

#[test]
fn the_derived_forward_is_the_structs_own_with_its_gradients() {
    let finished = Arc::new(AtomicUsize::new(0));
    let m = every(&finished);
    let tape = Tape::new();
    let x = tape.leaf(Tensor::from_vec(vec![1.5], &[1], &Device::cpu()).unwrap());
    let dynamic: &dyn Module = &m;
    let y = dynamic.forward(&x, &ForwardCtx::eval()).unwrap();
    // 1.5 * 2 * (1.5 * 3) + 1 + 10
    assert_eq!(y.to_scalar().unwrap(), 1.5 * 2.0 * 4.5 + 11.0);
    tape.backward(&y).unwrap();
    // d/d scale = x * child(x) = 6.75; d/d child.w = x * scale * x = 4.5; each extra: 1.
    let grad = |p: &Param| p.grad().unwrap().to_scalar().unwrap();
    assert_eq!(grad(&m.scale), 6.75);
    assert_eq!(grad(&m.child.w), 4.5);
    assert_eq!(grad(&m.extra[1]), 1.0);
}
