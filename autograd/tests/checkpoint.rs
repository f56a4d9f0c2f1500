//! Re-materialization: checkpointed gradients equal plain ones bit for bit (with dropout), the
//! peak memory is lower, and the segment re-runs on a recompute tape.

use std::cell::Cell;
use std::rc::Rc;

use wgpipe_autograd::tensor::{Device, Result, Tensor};
use wgpipe_autograd::{checkpoint, checkpoint_rerun_later, ForwardCtx, Param, Rerun, Tape, Var};

/// One block: `x + dropout(gelu(x @ w1 + b1)) @ w2` then tanh, with its params.
#[derive(Clone)]
struct Block {
    w1: Param,
    b1: Param,
    w2: Param,
    layer: u64,
    p: f32,
}

impl Block {
    fn new(dev: &Device, width: usize, hidden: usize, layer: u64, p: f32) -> Block {
        let seed = 100 + layer * 3;
        let s1 = 1.0 / (width as f32).sqrt();
        let s2 = 1.0 / (hidden as f32).sqrt();
        Block {
            w1: Param::new(
                format!("{layer}.w1"),
                Tensor::rand_uniform(&[width, hidden], -s1, s1, seed, dev).unwrap(),
            ),
            b1: Param::new(
                format!("{layer}.b1"),
                Tensor::rand_uniform(&[hidden], -0.1, 0.1, seed + 1, dev).unwrap(),
            ),
            w2: Param::new(
                format!("{layer}.w2"),
                Tensor::rand_uniform(&[hidden, width], -s2, s2, seed + 2, dev).unwrap(),
            ),
            layer,
            p,
        }
    }

    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let ctx = ctx.at_layer(self.layer);
        let h = x
            .matmul(&x.param(&self.w1)?)?
            .add(&x.param(&self.b1)?)?
            .gelu()?
            .dropout(self.p, &ctx, 0)?;
        x.add(&h.matmul(&h.param(&self.w2)?)?)?.tanh()
    }

    fn params(&self) -> Vec<Param> {
        vec![self.w1.clone(), self.b1.clone(), self.w2.clone()]
    }
}

struct Run {
    loss: f32,
    x_grad: Option<Vec<f32>>,
    param_grads: Vec<Vec<f32>>,
    peak: usize,
}

/// How `run` records each block.
#[derive(Clone, Copy, PartialEq)]
enum Ckpt {
    Plain,
    /// `checkpoint` with the block in its closure.
    Closure,
    /// `checkpoint_rerun_later`: the block run here without recording, re-run here before the
    /// backward.
    RerunLater,
    /// The same, re-run when the backward reaches it (`backward_roots_rerunning`, as a pipeline
    /// stage does).
    RerunLazily,
}

/// Forward + backward of `blocks` on `x`, each block checkpointed as `ckpt` says; the param
/// grads are read and cleared.
fn run(
    blocks: &[Block],
    x: &Tensor,
    ckpt: impl Into<Ckpt>,
    x_wants_grad: bool,
    ctx: ForwardCtx,
) -> Run {
    let ckpt = ckpt.into();
    let dev = x.device().clone();
    dev.memory().reset_peak();
    let tape = Tape::new();
    let xv = if x_wants_grad {
        tape.leaf(x.clone())
    } else {
        tape.constant(x.clone())
    };
    let mut h = xv.clone();
    let mut reruns: Vec<(Rc<Rerun>, &Block)> = Vec::new();
    for b in blocks {
        h = match ckpt {
            Ckpt::Plain => b.forward(&h, &ctx).unwrap(),
            Ckpt::Closure => {
                let b = b.clone();
                checkpoint(&h, move |x| b.forward(x, &ctx)).unwrap()
            }
            Ckpt::RerunLater | Ckpt::RerunLazily => {
                let y = b
                    .forward(&Tape::no_grad().constant(h.value().clone()), &ctx)
                    .unwrap();
                let (v, rerun) = checkpoint_rerun_later(&h, y.value().clone()).unwrap();
                reruns.push((rerun.expect("the tape records"), b));
                v
            }
        };
    }
    let loss = h.square().unwrap().mean_all().unwrap();
    drop(h);
    let rerun = |r: &Rc<Rerun>, b: &Block| {
        let re = Tape::recompute();
        let leaf = re.leaf(r.input().clone());
        let out = b.forward(&leaf, &ctx).unwrap();
        r.supply(re, leaf, out);
    };
    let grads = if ckpt == Ckpt::RerunLazily {
        let one = Tensor::ones(&[1], &dev)
            .unwrap()
            .reshape(loss.shape())
            .unwrap();
        // Each block's re-run is asked for once, the last block's first.
        let mut asked = Vec::new();
        let g = tape
            .backward_roots_rerunning(&[(&loss, &one)], &mut |r| {
                let i = reruns.iter().position(|(p, _)| Rc::ptr_eq(p, r)).unwrap();
                asked.push(i);
                rerun(r, reruns[i].1);
                Ok(())
            })
            .unwrap();
        let expected: Vec<usize> = (0..reruns.len()).rev().collect();
        assert_eq!(asked, expected, "re-runs asked for out of order");
        g
    } else {
        for (r, b) in &reruns {
            rerun(r, b);
        }
        tape.backward(&loss).unwrap()
    };
    let peak = dev.memory_stats().peak;
    let out = Run {
        loss: loss.to_scalar().unwrap(),
        x_grad: grads.get(&xv).map(|g| g.to_vec().unwrap()),
        param_grads: blocks
            .iter()
            .flat_map(|b| b.params())
            .map(|p| {
                p.grad()
                    .expect("every param gets a gradient")
                    .to_vec()
                    .unwrap()
            })
            .collect(),
        peak,
    };
    for p in blocks.iter().flat_map(|b| b.params()) {
        p.zero_grad();
    }
    out
}

impl From<bool> for Ckpt {
    fn from(closure: bool) -> Ckpt {
        if closure {
            Ckpt::Closure
        } else {
            Ckpt::Plain
        }
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

fn blocks(dev: &Device, n: usize, width: usize, hidden: usize, p: f32) -> Vec<Block> {
    (0..n as u64)
        .map(|l| Block::new(dev, width, hidden, l, p))
        .collect()
}

#[test]
fn checkpointed_gradients_equal_plain_bit_for_bit_with_dropout() {
    let dev = Device::new_cpu("ckpt-eq");
    let bs = blocks(&dev, 3, 8, 16, 0.25);
    let x = Tensor::rand_normal(&[4, 8], 0.0, 1.0, 9, &dev).unwrap();
    let ctx = ForwardCtx::train(42, 5, 2);
    let plain = run(&bs, &x, false, true, ctx);
    let ck = run(&bs, &x, true, true, ctx);
    assert_eq!(plain.loss.to_bits(), ck.loss.to_bits());
    assert_eq!(
        bits(plain.x_grad.as_ref().unwrap()),
        bits(ck.x_grad.as_ref().unwrap())
    );
    assert_eq!(plain.param_grads.len(), 9);
    for (a, b) in plain.param_grads.iter().zip(&ck.param_grads) {
        assert_eq!(bits(a), bits(b));
    }
    for mode in [Ckpt::RerunLater, Ckpt::RerunLazily] {
        let later = run(&bs, &x, mode, true, ctx);
        assert_eq!(plain.loss.to_bits(), later.loss.to_bits());
        assert_eq!(
            bits(plain.x_grad.as_ref().unwrap()),
            bits(later.x_grad.as_ref().unwrap())
        );
        for (a, b) in plain.param_grads.iter().zip(&later.param_grads) {
            assert_eq!(bits(a), bits(b));
        }
    }
    // dropout really dropped something, and another micro-batch drops something else
    let other = run(&bs, &x, false, true, ForwardCtx::train(42, 5, 3));
    assert_ne!(other.loss.to_bits(), plain.loss.to_bits());
    let eval = run(&bs, &x, false, true, ForwardCtx::eval());
    assert_ne!(eval.loss.to_bits(), plain.loss.to_bits());
}

#[test]
fn params_get_gradients_when_the_input_wants_none() {
    let dev = Device::new_cpu("ckpt-const");
    let bs = blocks(&dev, 2, 4, 8, 0.1);
    let x = Tensor::rand_normal(&[3, 4], 0.0, 1.0, 11, &dev).unwrap();
    let ctx = ForwardCtx::train(1, 0, 0);
    let plain = run(&bs, &x, false, false, ctx);
    let ck = run(&bs, &x, true, false, ctx);
    let later = run(&bs, &x, Ckpt::RerunLater, false, ctx);
    assert!(plain.x_grad.is_none() && ck.x_grad.is_none() && later.x_grad.is_none());
    for ((a, b), c) in plain
        .param_grads
        .iter()
        .zip(&ck.param_grads)
        .zip(&later.param_grads)
    {
        assert_eq!(bits(a), bits(b));
        assert_eq!(bits(a), bits(c));
    }
}

#[test]
fn checkpoint_lowers_the_peak_memory() {
    // fresh devices so the peaks are this test's alone
    let (dp, dc) = (Device::new_cpu("plain"), Device::new_cpu("ckpt"));
    let ctx = ForwardCtx::train(3, 1, 0);
    let (n, width, hidden, batch) = (8, 16, 256, 64);
    let bp = blocks(&dp, n, width, hidden, 0.1);
    let bc = blocks(&dc, n, width, hidden, 0.1);
    let xp = Tensor::rand_normal(&[batch, width], 0.0, 1.0, 5, &dp).unwrap();
    let xc = xp.to_device(&dc).unwrap();
    let plain = run(&bp, &xp, false, true, ctx);
    let ck = run(&bc, &xc, true, true, ctx);
    assert_eq!(plain.loss.to_bits(), ck.loss.to_bits());
    eprintln!("peak bytes: plain {} checkpointed {}", plain.peak, ck.peak);
    // plain keeps every block's activations (several batch x hidden tensors per block); the
    // checkpointed run keeps one batch x width tensor per block and one block's activations
    assert!(
        (ck.peak as f64) < 0.6 * plain.peak as f64,
        "checkpointed peak {} is not well below the plain peak {}",
        ck.peak,
        plain.peak
    );
}

#[test]
fn segment_reruns_on_a_recompute_tape_in_backward() {
    let calls = Rc::new(Cell::new((0, 0))); // (first runs, recomputes)
    let c = calls.clone();
    let tape = Tape::new();
    let x = tape.leaf(Tensor::from_slice(&[1.0, 2.0], &[2], &Device::cpu()).unwrap());
    let y = checkpoint(&x, move |v| {
        let (a, b) = c.get();
        if v.tape().is_recompute() {
            assert!(v.tape().is_recording());
            c.set((a, b + 1));
        } else {
            assert!(!v.tape().is_recording(), "the first run records nothing");
            c.set((a + 1, b));
        }
        v.square()?.exp()
    })
    .unwrap();
    assert_eq!(calls.get(), (1, 0));
    assert_eq!(tape.len(), 1, "one node for the whole segment");
    let loss = y.sum_all().unwrap();
    let g = tape.backward(&loss).unwrap();
    assert_eq!(calls.get(), (1, 1));
    let gx = g.get(&x).unwrap().to_vec().unwrap();
    let want: Vec<f32> = [1.0f32, 2.0]
        .iter()
        .map(|&v| 2.0 * v * (v * v).exp())
        .collect();
    for (a, b) in gx.iter().zip(&want) {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "{gx:?} vs {want:?}");
    }
}

/// A segment with a multi-output node (a gated unit: `a * sigmoid(b)` from `chunk(2)`, a third
/// of the input unused) gives, checkpointed, the input gradient of the plain run bit for bit.
#[test]
fn checkpointed_split_equals_plain_bit_for_bit() {
    let x = Tensor::rand_uniform(&[4, 12], -1.0, 1.0, 7, &Device::cpu()).unwrap();
    let gated = |v: &Var| -> Result<Var> {
        let p = v.split_sizes(&[4, 4, 4], 1)?;
        p[0].mul(&p[2].sigmoid()?)?.sum_all()
    };
    let grad = |ckpt: bool| -> Vec<u32> {
        let tape = Tape::new();
        let xv = tape.leaf(x.clone());
        let y = if ckpt {
            checkpoint(&xv, gated).unwrap()
        } else {
            gated(&xv).unwrap()
        };
        let g = tape.backward(&y).unwrap();
        bits(&g.get(&xv).unwrap().to_vec().unwrap())
    };
    let plain = grad(false);
    assert_eq!(grad(true), plain);
    // The unused middle third gets zeros, the gated thirds do not.
    let cols = |lo: usize| -> Vec<f32> {
        (0..4)
            .flat_map(|r| plain[r * 12 + lo..r * 12 + lo + 4].iter())
            .map(|&b| f32::from_bits(b))
            .collect()
    };
    assert!(cols(4).iter().all(|&v| v == 0.0), "{:?}", cols(4));
    assert!(cols(0).iter().chain(&cols(8)).all(|&v| v != 0.0));
}

#[test]
fn checkpoint_on_a_no_grad_tape_just_runs() {
    let tape = Tape::no_grad();
    let x = tape.constant(Tensor::from_slice(&[1.0, 2.0], &[2], &Device::cpu()).unwrap());
    let y = checkpoint(&x, |v| v.mul_scalar(2.0)).unwrap();
    assert_eq!(y.value().to_vec().unwrap(), vec![2.0, 4.0]);
    assert!(tape.is_empty());
}

#[test]
fn checkpoint_errors_propagate() {
    let tape = Tape::new();
    let x = tape.leaf(Tensor::zeros(&[2, 3], &Device::cpu()).unwrap());
    let e = checkpoint(&x, |v| v.matmul(v)).expect_err("shape error");
    assert!(e.to_string().contains("matmul"), "{e}");
}

#[test]
fn a_segment_re_run_later_errors_when_its_re_run_was_not_supplied() {
    let tape = Tape::new();
    let x = tape.leaf(Tensor::from_slice(&[1.0, 2.0], &[2], &Device::cpu()).unwrap());
    let y = x.value().mul_scalar(3.0).unwrap();
    let (v, rerun) = checkpoint_rerun_later(&x, y).unwrap();
    let rerun = rerun.expect("the tape records");
    assert_eq!(rerun.input().to_vec().unwrap(), vec![1.0, 2.0]);
    assert!(!rerun.is_supplied());
    let e = tape
        .backward(&v.sum_all().unwrap())
        .expect_err("no re-run was supplied");
    assert!(e.to_string().contains("not supplied"), "{e}");
    // Supplied, it back-propagates through the re-run: d(sum 3x)/dx = 3.
    let tape = Tape::new();
    let x = tape.leaf(Tensor::from_slice(&[1.0, 2.0], &[2], &Device::cpu()).unwrap());
    let (v, rerun) = checkpoint_rerun_later(&x, x.value().mul_scalar(3.0).unwrap()).unwrap();
    let rerun = rerun.unwrap();
    let re = Tape::recompute();
    let leaf = re.leaf(rerun.input().clone());
    let out = leaf.mul_scalar(3.0).unwrap();
    rerun.supply(re, leaf, out);
    assert!(rerun.is_supplied());
    let g = tape.backward(&v.sum_all().unwrap()).unwrap();
    assert_eq!(g.get(&x).unwrap().to_vec().unwrap(), vec![3.0, 3.0]);
    assert!(!rerun.is_supplied(), "the backward took the re-run");
    // On a tape that does not record, nothing is kept.
    let nt = Tape::no_grad();
    let (c, none) = checkpoint_rerun_later(
        &nt.constant(Tensor::zeros(&[1], &Device::cpu()).unwrap()),
        Tensor::ones(&[1], &Device::cpu()).unwrap(),
    )
    .unwrap();
    assert!(none.is_none() && nt.is_empty());
    assert_eq!(c.value().to_vec().unwrap(), vec![1.0]);
}
