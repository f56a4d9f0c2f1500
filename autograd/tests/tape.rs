//! The tape engine: gradients of reused vars, params, `backward_with`, no-grad, detach, memory
//! freed during backward, and the error cases.

use std::cell::Cell;
use std::rc::Rc;

use wgpipe_autograd::tensor::{Device, Error, Tensor};
use wgpipe_autograd::{Param, Tape, Var};

fn t(v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_slice(v, shape, &Device::cpu()).unwrap()
}

fn vals(t: &Tensor) -> Vec<f32> {
    t.to_vec().unwrap()
}

#[test]
fn scalar_backward_sums_reused_vars() {
    let tape = Tape::new();
    let x = tape.leaf(t(&[1.0, 2.0, 3.0], &[3]));
    let y = tape.leaf(t(&[4.0, 5.0, 6.0], &[3]));
    // loss = sum(x*y + x*x + x)  ->  dx = y + 2x + 1, dy = x
    let loss = x
        .mul(&y)
        .unwrap()
        .add(&x.mul(&x).unwrap())
        .unwrap()
        .add(&x)
        .unwrap()
        .sum_all()
        .unwrap();
    assert_eq!(loss.to_scalar().unwrap(), 32.0 + 14.0 + 6.0);
    let g = tape.backward(&loss).unwrap();
    assert_eq!(vals(g.get(&x).unwrap()), vec![7.0, 10.0, 13.0]);
    assert_eq!(vals(g.get(&y).unwrap()), vec![1.0, 2.0, 3.0]);
    assert_eq!(g.len(), 2);
}

/// A custom op with two results (`x * 2`, `x * x`): its backward runs once, after every use of
/// either output, with `None` for an output no gradient reached, and the tape sums its outputs'
/// uses before calling it (hand-computed values).
#[test]
fn a_multi_output_node_gets_each_outputs_gradient_once() {
    let tape = Tape::new();
    let x = tape.leaf(t(&[1.0, 2.0, 3.0], &[3]));
    let calls = Rc::new(Cell::new(0));
    let seen = Rc::new(std::cell::RefCell::new(Vec::new()));
    let two_results = |x: &Var| {
        let (calls, seen) = (calls.clone(), seen.clone());
        let xv = x.value().clone();
        let values = vec![
            x.value().mul_scalar(2.0).unwrap(),
            x.value().square().unwrap(),
        ];
        Var::from_op_multi("twice_and_square", &[x], values, move |gs, _| {
            calls.set(calls.get() + 1);
            seen.borrow_mut()
                .push(gs.iter().map(Option::is_some).collect::<Vec<_>>());
            let mut g = xv.zeros_like()?;
            if let Some(g0) = &gs[0] {
                g = g.add(&g0.mul_scalar(2.0)?)?;
            }
            if let Some(g1) = &gs[1] {
                g = g.add(&g1.mul(&xv.mul_scalar(2.0)?)?)?;
            }
            Ok(vec![Some(g)])
        })
        .unwrap()
    };
    // Both outputs, the second used twice: loss = sum(2x) + 2 sum(x^2); dx = 2 + 4x.
    let [a, b] = <[Var; 2]>::try_from(two_results(&x)).unwrap();
    let loss = a.add(&b).unwrap().add(&b).unwrap().sum_all().unwrap();
    let g = tape.backward(&loss).unwrap();
    assert_eq!(vals(g.get(&x).unwrap()), vec![6.0, 10.0, 14.0]);
    assert_eq!(
        (calls.get(), seen.borrow().clone()),
        (1, vec![vec![true, true]])
    );

    // Only the second output used: loss = sum(x^2); dx = 2x, and the first output's gradient is
    // None.
    let tape = Tape::new();
    let x = tape.leaf(t(&[1.0, 2.0, 3.0], &[3]));
    let outs = two_results(&x);
    let g = tape.backward(&outs[1].sum_all().unwrap()).unwrap();
    assert_eq!(vals(g.get(&x).unwrap()), vec![2.0, 4.0, 6.0]);
    assert_eq!(calls.get(), 2);
    assert_eq!(seen.borrow()[1], vec![false, true]);

    // Neither used: the node never runs.
    let tape = Tape::new();
    let x = tape.leaf(t(&[1.0, 2.0, 3.0], &[3]));
    let _ = two_results(&x);
    let g = tape.backward(&x.sum_all().unwrap()).unwrap();
    assert_eq!(vals(g.get(&x).unwrap()), vec![1.0, 1.0, 1.0]);
    assert_eq!(calls.get(), 2);
}

#[test]
fn backward_with_seeds_a_non_scalar_output() {
    let tape = Tape::new();
    let x = tape.leaf(t(&[1.0, 2.0, 3.0, 4.0], &[2, 2]));
    let y = x.mul_scalar(3.0).unwrap().square().unwrap(); // 9 x^2
    let go = t(&[1.0, 0.0, 0.5, -1.0], &[2, 2]);
    let g = tape.backward_with(&y, &go).unwrap();
    assert_eq!(vals(g.get(&x).unwrap()), vec![18.0, 0.0, 27.0, -72.0]);
}

#[test]
fn params_accumulate_across_tapes_and_frozen_params_get_none() {
    let w = Param::new("w", t(&[2.0, -1.0], &[2]));
    let frozen = Param::new("f", t(&[1.0, 1.0], &[2]));
    frozen.set_trainable(false);
    for _ in 0..2 {
        // one tape per micro-batch; the param is used twice on each
        let tape = Tape::new();
        let x = tape.constant(t(&[3.0, 4.0], &[2]));
        let (wv, wv2, fv) = (
            tape.stored_param(&w),
            tape.stored_param(&w),
            tape.stored_param(&frozen),
        );
        assert!(wv.requires_grad() && !fv.requires_grad());
        let loss = x
            .mul(&wv)
            .unwrap()
            .add(&wv2)
            .unwrap()
            .mul(&fv)
            .unwrap()
            .sum_all()
            .unwrap();
        let g = tape.backward(&loss).unwrap();
        assert!(
            g.get(&wv).is_none() && g.get(&x).is_none(),
            "params and constants are not leaves"
        );
    }
    // d/dw sum((x*w + w) * 1) = x + 1, twice
    assert_eq!(vals(&w.grad().unwrap()), vec![8.0, 10.0]);
    assert!(frozen.grad().is_none());
}

#[test]
fn constants_record_nothing_and_detach_stops_the_gradient() {
    let tape = Tape::new();
    let a = tape.constant(t(&[1.0, 2.0], &[2]));
    let b = a.exp().unwrap().add(&a).unwrap();
    assert!(!b.requires_grad());
    assert!(tape.is_empty(), "ops on constants record no node");

    let x = tape.leaf(t(&[1.0, 2.0], &[2]));
    let loss = x.mul(&x.detach()).unwrap().sum_all().unwrap();
    let g = tape.backward(&loss).unwrap();
    assert_eq!(
        vals(g.get(&x).unwrap()),
        vec![1.0, 2.0],
        "not 2x: one factor is detached"
    );
}

#[test]
fn unused_leaf_has_no_gradient() {
    let tape = Tape::new();
    let x = tape.leaf(t(&[1.0], &[1]));
    let unused = tape.leaf(t(&[1.0], &[1]));
    let loss = x.square().unwrap().sum_all().unwrap();
    let g = tape.backward(&loss).unwrap();
    assert!(g.get(&unused).is_none());
    assert_eq!(vals(g.get(&x).unwrap()), vec![2.0]);
}

#[test]
fn no_grad_records_and_keeps_nothing() {
    let dev = Device::new_cpu("nograd");
    let tape = Tape::no_grad();
    assert!(!tape.is_recording());
    let x = tape.leaf(Tensor::ones(&[256], &dev).unwrap());
    let p = Param::new("p", Tensor::ones(&[256], &dev).unwrap());
    let base = dev.memory_stats().live;
    let mut h = x.mul(&tape.stored_param(&p)).unwrap();
    for _ in 0..10 {
        h = h.tanh().unwrap().exp().unwrap();
    }
    assert!(!h.requires_grad());
    assert!(tape.is_empty());
    // only the last value is alive
    assert_eq!(dev.memory_stats().live, base + 256 * 4);
    let loss = h.sum_all().unwrap();
    let e = tape.backward(&loss).unwrap_err();
    assert!(e.to_string().contains("no_grad"), "{e}");
}

#[test]
fn backward_frees_each_nodes_saved_tensors_as_it_goes() {
    const N: usize = 1024;
    const LAYERS: usize = 8;
    let dev = Device::new_cpu("free");
    let tape = Tape::new();
    let x = tape.leaf(Tensor::full(&[N], 0.5, &dev).unwrap());
    // a probe as the first node: its backward runs last and reads the live bytes then
    let seen = Rc::new(Cell::new(usize::MAX));
    let (s, d) = (seen.clone(), dev.clone());
    let mut h = Var::from_op("probe", &[&x], x.value().clone(), move |g, _| {
        s.set(d.memory_stats().live);
        Ok(vec![Some(g.clone())])
    })
    .unwrap();
    for _ in 0..LAYERS {
        h = h.tanh().unwrap(); // each node keeps its output (N floats)
    }
    let loss = h.sum_all().unwrap();
    drop(h);
    let after_forward = dev.memory_stats().live;
    assert!(after_forward >= (LAYERS + 1) * N * 4, "{after_forward}");
    let g = tape.backward(&loss).unwrap();
    let at_probe = seen.get();
    // by the time the first node runs, the saved outputs of all later nodes are gone: what is
    // left is x, the incoming gradient and the scalars
    assert!(
        at_probe <= after_forward - (LAYERS - 2) * N * 4,
        "live at the probe {at_probe} vs after forward {after_forward}"
    );
    assert!(at_probe <= 3 * N * 4, "{at_probe}");
    // afterwards: x, its gradient and the loss
    let end = dev.memory_stats().live;
    assert!(end <= 2 * N * 4 + 64, "{end}");
    drop(g);
    drop(loss);
    assert_eq!(dev.memory_stats().live, N * 4, "only x is left");
    assert!(tape.is_empty());
}

#[test]
fn non_scalar_backward_without_a_gradient_is_an_error() {
    let tape = Tape::new();
    let x = tape.leaf(t(&[1.0, 2.0], &[2]));
    let y = x.exp().unwrap();
    let e = tape.backward(&y).unwrap_err();
    let m = e.to_string();
    assert!(m.contains("[2]") && m.contains("backward_with"), "{m}");
    // the tape is still usable after that refusal
    assert!(tape.backward_with(&y, &t(&[1.0, 1.0], &[2])).is_ok());
}

#[test]
fn mismatched_gradient_shape_names_both_shapes() {
    let tape = Tape::new();
    let x = tape.leaf(t(&[1.0; 6], &[2, 3]));
    let y = x.sin().unwrap();
    let e = tape.backward_with(&y, &t(&[1.0; 6], &[3, 2])).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e:?}");
    let m = e.to_string();
    assert!(m.contains("[3, 2]") && m.contains("[2, 3]"), "{m}");
}

#[test]
fn second_backward_is_an_error() {
    let tape = Tape::new();
    let x = tape.leaf(t(&[1.0], &[1]));
    let loss = x.square().unwrap().sum_all().unwrap();
    tape.backward(&loss).unwrap();
    let e = tape.backward(&loss).unwrap_err();
    assert!(e.to_string().contains("already ran"), "{e}");
    assert!(!tape.is_recording(), "a spent tape records nothing more");
}

#[test]
fn vars_from_another_tape_are_an_error() {
    let (t1, t2) = (Tape::new(), Tape::new());
    let a = t1.leaf(t(&[1.0], &[1]));
    let b = t2.leaf(t(&[2.0], &[1]));
    let e = a.add(&b).unwrap_err();
    assert!(matches!(e, Error::Invalid { op: "add", .. }), "{e:?}");
    assert!(e.to_string().contains("different tapes"), "{e}");
    assert!(Var::concat(&[&a, &b], 0).is_err());
    assert!(a.matmul(&b).is_err());
    // backward of a var of another tape
    let l = b.sum_all().unwrap();
    let e = t1.backward(&l).unwrap_err();
    assert!(e.to_string().contains("another tape"), "{e}");
    // a no-grad tape's var mixed into a recording tape
    let n = Tape::no_grad().constant(t(&[1.0], &[1]));
    assert!(a.mul(&n).is_err());
}

#[test]
fn op_errors_come_back_as_errs() {
    let tape = Tape::new();
    let a = tape.leaf(t(&[1.0; 6], &[2, 3]));
    let b = tape.leaf(t(&[1.0; 6], &[2, 3]));
    assert!(matches!(a.matmul(&b), Err(Error::Shape { .. })));
    assert!(a.sum(&[5], false).is_err());
    assert!(a.add(&tape.leaf(t(&[1.0; 4], &[4]))).is_err());
}

#[test]
fn backward_from_several_roots_sums_their_contributions() {
    // y1 = x * w (seed g1), y2 = x * x (seed g2), and y1 seeded a second time (g3): the seeds
    // of one root add up, so dx = (g1 + g3) * w + 2 x g2 and dw = (g1 + g3) * x.
    let tape = Tape::new();
    let x = tape.leaf(t(&[1.0, -2.0], &[2]));
    let w = Param::new("w", t(&[3.0, 0.5], &[2]));
    let y1 = x.mul(&tape.stored_param(&w)).unwrap();
    let y2 = x.mul(&x).unwrap();
    let (g1, g2, g3) = (
        t(&[1.0, 2.0], &[2]),
        t(&[0.5, -1.0], &[2]),
        t(&[2.0, 1.0], &[2]),
    );
    let grads = tape
        .backward_roots(&[(&y1, &g1), (&y2, &g2), (&y1, &g3)])
        .unwrap();
    // dx = (1+2)*3 + 2*1*0.5 = 10, (2+1)*0.5 + 2*(-2)*(-1) = 5.5
    assert_eq!(vals(grads.get(&x).unwrap()), vec![10.0, 5.5]);
    // dw = (1+2)*1 = 3, (2+1)*(-2) = -6
    assert_eq!(vals(&w.grad().unwrap()), vec![3.0, -6.0]);

    // A root that is a leaf itself gets its seed as its gradient; the split backward agrees.
    let tape = Tape::new();
    let x = tape.leaf(t(&[1.0, -2.0], &[2]));
    let y = x.mul(&x).unwrap();
    let (grads, weights) = tape.backward_split_roots(&[(&y, &g1), (&x, &g2)]).unwrap();
    weights.run().unwrap();
    // dx = 2 x g1 + g2 = 2*1*1 + 0.5, 2*(-2)*2 - 1
    assert_eq!(vals(grads.get(&x).unwrap()), vec![2.5, -9.0]);
}
