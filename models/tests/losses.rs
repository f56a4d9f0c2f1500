//! Losses against hand-computed values.

mod common;

use common::*;
use wgpipe_autograd::Tape;
use wgpipe_models::{cross_entropy, mse};

#[test]
fn cross_entropy_values() {
    let tape = Tape::no_grad();
    let l = cross_entropy(&tape.constant(t(&[0., 0.], &[1, 2])), &t(&[1.], &[1])).unwrap();
    assert!((l.to_scalar().unwrap() - 2f32.ln()).abs() < 1e-6);
    // Mean over positions [2, 1, 3] -> two rows.
    let logits = tape.constant(t(&[1., 2., 3., 0., 0., 5.], &[2, 1, 3]));
    let l = cross_entropy(&logits, &t(&[2., 0.], &[2, 1])).unwrap();
    let r0 = (1f32.exp() + 2f32.exp() + 3f32.exp()).ln() - 3.0;
    let r1 = (2.0 + 5f32.exp()).ln();
    assert!((l.to_scalar().unwrap() - (r0 + r1) / 2.0).abs() < 1e-5);
    // Shape mismatch and out-of-range targets are errors.
    assert!(cross_entropy(&logits, &t(&[2., 0.], &[2])).is_err());
    assert!(cross_entropy(&logits, &t(&[3., 0.], &[2, 1])).is_err());
}

#[test]
fn mse_values() {
    let tape = Tape::no_grad();
    let p = tape.constant(t(&[1., 2., 3., 4.], &[2, 2]));
    let l = mse(&p, &t(&[1., 0., 3., 1.], &[2, 2])).unwrap();
    assert!((l.to_scalar().unwrap() - 13.0 / 4.0).abs() < 1e-6);
    assert!(mse(&p, &t(&[1., 0.], &[2])).is_err());
}

#[test]
fn fused_cross_entropy_equals_the_composed_ops_bit_for_bit() {
    // Loss and logits gradient of the fused op against log_softmax, gather, mean and neg (the
    // ops `cross_entropy` was made of), with a non-unit seed as a pipeline's scaled loss has.
    let logits = rand(&[4, 6, 11], 5).mul_scalar(3.0).unwrap();
    let targets = t(
        &(0..24)
            .map(|i| ((i * 7 + 3) % 11) as f32)
            .collect::<Vec<_>>(),
        &[4, 6],
    );
    let run = |f: &dyn Fn(&wgpipe_autograd::Var) -> wgpipe_autograd::Var| {
        let tape = Tape::new();
        let x = tape.leaf(logits.clone());
        let l = f(&x);
        let seed = t(&[0.37], &[]);
        let g = tape.backward_with(&l, &seed).unwrap();
        (vals(l.value()), vals(g.get(&x).unwrap()))
    };
    let fused = run(&|x| cross_entropy(x, &targets).unwrap());
    let composed = run(&|x| {
        let lp = x.reshape(&[24, 11]).unwrap().log_softmax(-1).unwrap();
        lp.gather(1, &targets.reshape(&[24, 1]).unwrap())
            .unwrap()
            .mean(&[], false)
            .unwrap()
            .neg()
            .unwrap()
    });
    assert_eq!(fused, composed);
}
