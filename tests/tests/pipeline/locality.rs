//! Rank-local construction and forward-only rounds (issue 32, parts 1 and 3): a pipeline built
//! from a model factory starts from the whole model's parameters bit for bit whatever K and
//! partition; `Pipeline::evaluate` and `Pipeline::predict` equal the whole model run plainly.

use std::collections::HashMap;

use wgpipe_autograd::{layer_param_name, ForwardCtx, Module, Tape};
use wgpipe_models::{cross_entropy, forward_all, TransformerLm};
use wgpipe_pipeline::{Balance, Pipeline, ScheduleKind, SimCluster};
use wgpipe_tensor::{Device, Tensor};
use wgpipe_tests::*;

fn lm() -> TransformerLm {
    TransformerLm {
        layers: 5,
        ..transformer_cfg(0.0)
    }
}

/// Every parameter and buffer of `layers` (global names), as bits.
fn bits_of(layers: &[Box<dyn Module>]) -> HashMap<String, Vec<u32>> {
    let mut out = HashMap::new();
    for (i, l) in layers.iter().enumerate() {
        for (n, p) in l.parameters().into_iter().chain(l.buffers()) {
            let v = p.value().to_vec().unwrap();
            out.insert(
                layer_param_name(i, &n),
                v.iter().map(|x| x.to_bits()).collect(),
            );
        }
    }
    out
}

/// A pipeline of `cfg` built from its factory on `k` simulated devices with `balance`.
fn from_factory(cfg: &TransformerLm, k: usize, m: usize, balance: Vec<usize>) -> Pipeline {
    let cpu = Device::cpu();
    Pipeline::builder_from(cfg.factory(SEED, &cpu))
        .unwrap()
        .sim(SimCluster::uniform(
            &cpu,
            k,
            1 << 30,
            1e9,
            wgpipe_pipeline::LinkSpec::FREE,
        ))
        .balance(Balance::Explicit(balance))
        .micro_batches(m)
        .schedule(ScheduleKind::OneFOneB)
        .seed(SEED)
        .optimizer(sgd)
        .build()
        .unwrap()
}

#[test]
fn a_factory_built_pipeline_starts_from_the_whole_models_parameters_bit_for_bit() {
    let cfg = lm();
    let whole = bits_of(&cfg.build(SEED, &Device::cpu()).unwrap());
    for (k, balance) in [
        (1, vec![8]),
        (2, vec![3, 5]),
        (4, vec![1, 2, 2, 3]),
        (4, vec![3, 2, 2, 1]),
    ] {
        let pipe = from_factory(&cfg, k, 2, balance.clone());
        let mut got = HashMap::new();
        for (name, p) in pipe
            .named_parameters()
            .into_iter()
            .chain(pipe.named_buffers())
        {
            let v = p.value().to_vec().unwrap();
            got.insert(name, v.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        }
        assert_eq!(got.len(), whole.len(), "K={k} {balance:?}");
        for (name, want) in &whole {
            assert_eq!(got.get(name), Some(want), "K={k} {balance:?}: {name}");
        }
        // The tied head's copy starts from the table, on whichever stage it is.
        let head = format!("{}.weight", cfg.num_layers() - 1);
        assert_eq!(got[&head], whole["0.tok.weight"], "K={k} {balance:?}");
    }
}

#[test]
fn evaluate_equals_the_whole_model_run_plainly() {
    let cfg = lm();
    let (n, t) = (6, cfg.seq_len);
    let x = token_ids(n, t, cfg.vocab, 1);
    let y = token_ids(n, t, cfg.vocab, 2);
    let whole = cfg.build(SEED, &Device::cpu()).unwrap();
    let tape = Tape::no_grad();
    // The reference: each micro-batch (rows 2+2+2, as split_batch cuts 6 rows into M = 3)
    // through the plain model, its mean loss weighted by its rows, summed in order: the
    // definition `evaluate` documents, so the bits must agree.
    let mut want = 0.0f32;
    for mb in 0..3 {
        let xs = x.narrow(0, 2 * mb, 2).unwrap();
        let ys = y.narrow(0, 2 * mb, 2).unwrap();
        let logits = forward_all(&whole, &tape.constant(xs), &ForwardCtx::eval()).unwrap();
        want += cross_entropy(&logits, &ys)
            .unwrap()
            .mul_scalar(2.0 / 6.0)
            .unwrap()
            .value()
            .to_scalar()
            .unwrap();
    }
    // And the mean over the whole batch at once: the same up to the summation order.
    let all = forward_all(&whole, &tape.constant(x.clone()), &ForwardCtx::eval()).unwrap();
    let batch_mean = cross_entropy(&all, &y)
        .unwrap()
        .value()
        .to_scalar()
        .unwrap();
    assert!(((want - batch_mean) / batch_mean).abs() < 1e-6);
    for (k, balance) in [(1, vec![8]), (2, vec![4, 4]), (4, vec![2, 2, 2, 2])] {
        let mut pipe = from_factory(&cfg, k, 3, balance);
        let got = pipe.evaluate(&x, &y, &|l, t| cross_entropy(l, t)).unwrap();
        assert_eq!(got.to_bits(), want.to_bits(), "K={k}: {got} vs {want}");
    }
}

#[test]
fn evaluate_with_replicas_is_replica_0s_on_the_whole_batch() {
    let cfg = lm();
    let x = token_ids(8, cfg.seq_len, cfg.vocab, 3);
    let y = token_ids(8, cfg.seq_len, cfg.vocab, 4);
    let mut one = from_factory(&cfg, 2, 2, vec![4, 4]);
    let alone = one.evaluate(&x, &y, &|l, t| cross_entropy(l, t)).unwrap();
    let c = cfg.clone();
    let mut two = dp_sim_pipeline(
        2,
        move || c.build(SEED, &Device::cpu()).unwrap(),
        &PipeCfg::new(
            2,
            2,
            wgpipe_pipeline::CheckpointMode::Never,
            ScheduleKind::OneFOneB,
        )
        .balance(vec![4, 4]),
    )
    .unwrap();
    let got = two.evaluate(&x, &y, &|l, t| cross_entropy(l, t)).unwrap();
    // The replicas hold the same parameters: replica 0 runs the whole batch, as alone.
    assert_eq!(got.to_bits(), alone.to_bits(), "{got} vs {alone}");
}

#[test]
fn predict_keeps_what_the_head_asks_of_the_whole_models_output() {
    let cfg = lm();
    let (n, t) = (4, 5);
    let x = token_ids(n, t, cfg.vocab, 5);
    let whole = cfg.build(SEED, &Device::cpu()).unwrap();
    let tape = Tape::no_grad();
    // The reference: the plain model on each micro-batch (M = 2 of 2 rows): a matmul's bits
    // depend on how many rows it multiplies, so the whole batch at once differs in the last
    // place.
    let mut want = Vec::new();
    for mb in 0..2 {
        let xs = tape.constant(x.narrow(0, 2 * mb, 2).unwrap());
        let logits = forward_all(&whole, &xs, &ForwardCtx::eval()).unwrap();
        want.extend(
            logits
                .value()
                .narrow(1, t - 1, 1)
                .unwrap()
                .to_vec()
                .unwrap(),
        );
    }
    for (k, balance) in [(1, vec![8]), (4, vec![2, 2, 2, 2])] {
        let mut pipe = from_factory(&cfg, k, 2, balance);
        let got = pipe
            .predict(&x, &move |l: &Tensor| l.narrow(1, t - 1, 1))
            .unwrap();
        assert_eq!(got.shape(), &[n, 1, cfg.vocab]);
        assert_eq!(got.to_vec().unwrap(), want, "K={k}");
    }
}

/// The forwards of every schedule kind, on its own placement (looped and V-shaped ones
/// included), evaluate to the bits of one device: a forward-only schedule keeps each
/// kind's forward order and cannot deadlock.
#[test]
fn every_schedule_kinds_forwards_evaluate_alike() {
    let cfg = lm();
    // M = 4 micro-batches of 2 rows (DualPipeV needs M >= 2K).
    let x = token_ids(8, cfg.seq_len, cfg.vocab, 6);
    let y = token_ids(8, cfg.seq_len, cfg.vocab, 7);
    let loss = |l: &wgpipe_autograd::Var, t: &Tensor| cross_entropy(l, t);
    let want = from_factory(&cfg, 1, 4, vec![8])
        .evaluate(&x, &y, &loss)
        .unwrap();
    for kind in ScheduleKind::ALL {
        let chunks = kind.default_chunks();
        let cpu = Device::cpu();
        let mut pipe = Pipeline::builder_from(cfg.factory(SEED, &cpu))
            .unwrap()
            .sim(SimCluster::uniform(
                &cpu,
                2,
                1 << 30,
                1e9,
                wgpipe_pipeline::LinkSpec::FREE,
            ))
            .balance(Balance::Explicit(even_balance(8, 2 * chunks)))
            .micro_batches(4)
            .schedule(kind)
            .chunks(chunks)
            .build()
            .unwrap();
        let got = pipe.evaluate(&x, &y, &loss).unwrap();
        assert_eq!(got.to_bits(), want.to_bits(), "{kind:?}: {got} vs {want}");
    }
}

/// What a factory-built pipeline cannot do is refused at once, saying why: balancing by
/// measured time and planning both run every layer.
#[test]
fn a_factory_builder_refuses_what_needs_every_layer_run() {
    let cfg = lm();
    let cpu = Device::cpu();
    let e = Pipeline::builder_from(cfg.factory(SEED, &cpu))
        .unwrap()
        .devices(vec![cpu.clone(), cpu.clone()])
        .balance(Balance::ByTime {
            sample: token_ids(2, cfg.seq_len, cfg.vocab, 0),
        })
        .build()
        .err()
        .unwrap();
    assert!(e.to_string().contains("Balance::ByTime"), "{e}");
}
