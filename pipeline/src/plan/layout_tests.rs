//! Where the links of a two-level cluster change the right layout: on 2 nodes of 2 devices,
//! 2 replicas of a 2-stage pipeline either keep each replica in a node (stage transfers inside
//! a node, the gradient rings between nodes) or deal the stages out (each stage's replicas in
//! one node, the transfers between nodes). Big parameters and small activations want the
//! rings inside the nodes, the reverse wants the transfers there; the planner must pick each
//! and predict the step computed here by hand.

use super::{plan_on, Affine, LayerProfile, PlanOptions, Profile};
use crate::schedule::ScheduleKind;
use crate::sim::timeline::{DeviceSpec, LinkSpec};
use crate::sim::topology::Topology;

const RATE: f64 = 1e12;
/// Forward FLOPs of a layer per sample: 1 ms at RATE; its backward twice that.
const FLOPS: f64 = 1e9;
const INTRA: LinkSpec = LinkSpec {
    bandwidth_bytes_per_sec: 300e9,
    latency_sec: 1e-6,
};
const INTER: LinkSpec = LinkSpec {
    bandwidth_bytes_per_sec: 25e9,
    latency_sec: 5e-6,
};

fn per_sample(x: f64) -> Affine {
    Affine {
        fixed: 0.0,
        per_sample: x,
    }
}

/// Two equal layers of `params` bytes of parameters each, each sending `activation` bytes per
/// sample; no memory pressure, no loss cost.
fn profile(params: u64, activation: f64) -> Profile {
    let layer = LayerProfile {
        forward_flops: per_sample(FLOPS),
        backward_flops: per_sample(2.0 * FLOPS),
        backward_flops_from_data: per_sample(2.0 * FLOPS),
        backward_input_flops: per_sample(FLOPS),
        backward_input_flops_from_data: per_sample(FLOPS),
        backward_weight_flops: per_sample(FLOPS),
        param_bytes: params,
        grad_bytes: params,
        output_bytes: per_sample(activation),
        ..LayerProfile::default()
    };
    Profile {
        layers: vec![layer.clone(), layer],
        profiled_at: 1,
        ..Profile::default()
    }
}

/// GPipe, K = 2, R = 2, M = 1, one sample per replica: stage 0's forward (1 ms), the
/// activation over the stage link, stage 1's forward and backward (3 ms), the gradient back,
/// stage 0's backward (2 ms); then device 0's ring all-reduce of one layer's parameters across
/// 2 replicas: 2 (R - 1) / R of them over the ring's link plus 2 (R - 1) latencies. (Stage 1's
/// ring ends 2 ms earlier.)
fn by_hand(params: f64, activation: f64, stage_link: LinkSpec, ring_link: LinkSpec) -> f64 {
    let f = FLOPS / RATE;
    let transfer = activation / stage_link.bandwidth_bytes_per_sec + stage_link.latency_sec;
    let ring = params / ring_link.bandwidth_bytes_per_sec + 2.0 * ring_link.latency_sec;
    6.0 * f + 2.0 * transfer + ring
}

/// The plan on 4 devices in 2 nodes of 2, pipelines of 2 stages, GPipe with M = 1, batch 2.
fn planned(params: u64, activation: f64) -> super::PlanReport {
    let specs = vec![
        DeviceSpec {
            flops_per_sec: RATE,
            memory_bytes: u64::MAX,
        };
        4
    ];
    let links = Topology::nodes(4, 2, INTRA, INTER).unwrap();
    let options = PlanOptions {
        kinds: vec![ScheduleKind::GPipe],
        micro_batches: Some(vec![1]),
        min_stages: 2,
        ..PlanOptions::default()
    };
    plan_on(&profile(params, activation), &specs, &links, 2, &options).unwrap()
}

/// Whether replica 0's two stages sit in one node.
fn replica_in_a_node(order: &[usize]) -> bool {
    order[0] / 2 == order[1] / 2
}

#[test]
fn big_parameters_keep_the_all_reduce_inside_a_node() {
    let (params, activation) = (400e6, 1e6);
    let r = planned(params as u64, activation);
    let c = &r.best.candidate;
    assert_eq!((c.replicas, c.pipeline_devices()), (2, 2), "{r}");
    assert!(
        !replica_in_a_node(&c.order),
        "stages dealt across nodes: {r}"
    );
    let dealt = by_hand(params, activation, INTER, INTRA);
    let kept = by_hand(params, activation, INTRA, INTER);
    // 6 ms + 2 x 45 us + 1.335 ms, against 6 ms + 2 x 4.3 us + 16.01 ms.
    assert!(dealt < kept);
    let got = r.best.prediction.step_secs;
    assert!(
        (got - dealt).abs() <= 1e-9 * dealt,
        "{got} vs {dealt} by hand"
    );
    // One pipeline of 2 devices on the whole batch (2 ms per sample per stage, no ring) is
    // slower still: 12 ms + 2 transfers of 2 samples.
    assert!(dealt < 12e-3);
}

#[test]
fn big_activations_keep_the_stages_inside_a_node() {
    let (params, activation) = (1e6, 400e6);
    let r = planned(params as u64, activation);
    let c = &r.best.candidate;
    assert_eq!((c.replicas, c.pipeline_devices()), (2, 2), "{r}");
    assert!(replica_in_a_node(&c.order), "each replica in a node: {r}");
    let kept = by_hand(params, activation, INTRA, INTER);
    let dealt = by_hand(params, activation, INTER, INTRA);
    // 6 ms + 2 x 1.335 ms + 50 us, against 6 ms + 2 x 16.005 ms + 5.3 us.
    assert!(kept < dealt);
    let got = r.best.prediction.step_secs;
    assert!((got - kept).abs() <= 1e-9 * kept, "{got} vs {kept} by hand");
}

/// On one kind of link (the fast one) both layouts cost the same: it is the slower link
/// between nodes that separates them.
#[test]
fn one_node_makes_the_layouts_equal() {
    let (params, activation) = (400e6, 1e6);
    let one = by_hand(params, activation, INTRA, INTRA);
    let specs = vec![
        DeviceSpec {
            flops_per_sec: RATE,
            memory_bytes: u64::MAX,
        };
        4
    ];
    let options = PlanOptions {
        kinds: vec![ScheduleKind::GPipe],
        micro_batches: Some(vec![1]),
        min_stages: 2,
        ..PlanOptions::default()
    };
    let p = profile(params as u64, activation);
    let r = plan_on(&p, &specs, &Topology::flat(INTRA), 2, &options).unwrap();
    let got = r.best.prediction.step_secs;
    assert!((got - one).abs() <= 1e-9 * one, "{got} vs {one} by hand");
}
