//! Skips across stages: where they travel (straight from the producer's stage to the
//! consumer's, shown in the trace and costed by the simulator's link), who holds their bytes, how
//! far they span, and the build-time errors of skips that do not pair up.

use wgpipe_autograd::Module;
use wgpipe_models::Linear;
use wgpipe_pipeline::{
    ActionKind, CheckpointMode, LinkSpec, Pipeline, ScheduleKind, SkipRoute, StepReport,
};
use wgpipe_tensor::{Device, Tag};
use wgpipe_tests::*;

const N: usize = 8;
const W: usize = 16;

/// Skips of `long_skip`, each N x W floats: together larger than the timing slack of a peak.
const SKIPS: usize = 4;

/// How much a stage's measured peak moves with thread timing: a sent activation (N x W floats)
/// stays on the sender's device until the receiver takes it (see memory.rs).
const SLACK: usize = N * W * 4;

/// 6 layers in 3 stages of 2: `SKIPS` skips (`linear_i(x)`) from layer 0 (stage 0) to layer 4
/// (stage 2) when `with_skip`; the same layers without them otherwise.
fn long_skip(with_skip: bool) -> Vec<Box<dyn Module>> {
    let d = Device::cpu();
    let (mut stash, mut pop) = (SkipLayer::new(), SkipLayer::new());
    if with_skip {
        for i in 0..SKIPS {
            let name = format!("s{i}");
            stash = stash.stash_linear(&name, W, 10 + i as u64);
            pop = pop.pop(&name);
        }
    }
    vec![
        Box::new(stash),
        Box::new(Linear::new(W, W, 1, &d).unwrap()),
        Box::new(Linear::new(W, W, 2, &d).unwrap()),
        Box::new(Linear::new(W, W, 3, &d).unwrap()),
        Box::new(pop),
        Box::new(Linear::new(W, W, 4, &d).unwrap()),
    ]
}

fn step(with_skip: bool, m: usize, mode: CheckpointMode, link: LinkSpec) -> StepReport {
    let x = normal_data(&[N, W], 3);
    let y = normal_data(&[N, W], 4);
    let mut cfg = PipeCfg::new(3, m, mode, ScheduleKind::GPipe).balance(vec![2, 2, 2]);
    cfg.link = link;
    let mut pipe = sim_pipeline(long_skip(with_skip), &cfg);
    pipe.train_step(&x, &y, &mse).unwrap()
}

#[test]
fn a_skip_goes_straight_to_its_consumer_and_the_stage_between_holds_none_of_it() {
    let skip_bytes = SKIPS * N * W * 4;
    for mode in ALL_MODES {
        let with = step(true, 1, mode, LinkSpec::FREE);
        let without = step(false, 1, mode, LinkSpec::FREE);
        let peak = |r: &StepReport, s: usize| r.stages[s].memory.peak_of(Tag::Activations);
        assert!(
            peak(&with, 1) <= peak(&without, 1) + SLACK,
            "{mode}: the stage between holds some of the skips ({} bytes at peak, {} without)",
            peak(&with, 1),
            peak(&without, 1)
        );
        assert!(
            peak(&with, 2) + SLACK >= peak(&without, 2) + skip_bytes,
            "{mode}: the consumer's peak {} does not hold the {skip_bytes} skip bytes over {}",
            peak(&with, 2),
            peak(&without, 2)
        );
        // The per-stage report: the producer sent the skip, the consumer its gradient, the stage
        // between the same as without it.
        let sent = |r: &StepReport, s: usize| r.stages[s].bytes_sent;
        assert_eq!(
            sent(&with, 0),
            sent(&without, 0) + skip_bytes as u64,
            "{mode}"
        );
        assert_eq!(sent(&with, 1), sent(&without, 1), "{mode}");
        assert_eq!(
            sent(&with, 2),
            sent(&without, 2) + skip_bytes as u64,
            "{mode}"
        );
    }
}

#[test]
fn skip_transfers_are_timeline_events_between_producer_and_consumer_costed_by_the_link() {
    let link = LinkSpec {
        bandwidth_bytes_per_sec: 1e6,
        latency_sec: 1e-3,
    };
    let m = 2;
    let r = step(true, m, CheckpointMode::ExceptLast, link);
    let sim = r.simulated.as_ref().unwrap();
    let skips: Vec<_> = sim
        .timeline
        .events
        .iter()
        .filter(|e| matches!(e.kind, ActionKind::SendSkip | ActionKind::SendSkipGrad))
        .collect();
    assert_eq!(
        skips.len(),
        2 * SKIPS * m,
        "each skip and its gradient per micro-batch"
    );
    let bytes = (N / m * W * 4) as f64;
    for e in &skips {
        let (from, to) = match e.kind {
            ActionKind::SendSkip => (0, 2),
            _ => (2, 0),
        };
        assert_eq!((e.device, e.peer), (from, Some(to)), "{e:?}");
        let want = bytes / link.bandwidth_bytes_per_sec + link.latency_sec;
        assert!(
            (e.end - e.start - want).abs() < 1e-9,
            "{e:?} lasts {} s, the link gives {want} s",
            e.end - e.start
        );
    }
    let json = r.chrome_trace_json("skips");
    assert!(json.contains("\"skip\"") && json.contains("\"skip gradient\""));
}

/// The stages (virtual, in model order) each skip of `skip_model` goes between.
fn spans(k: usize, schedule: ScheduleKind) -> Vec<usize> {
    let cfg = PipeCfg::new(k, 4, CheckpointMode::Never, schedule);
    let pipe = sim_pipeline(skip_model(21), &cfg);
    let mut v: Vec<usize> = pipe
        .stages()
        .iter()
        .flat_map(|s| s.skips.outgoing.iter().map(move |(id, _)| (*id, s.index)))
        .map(|(id, from)| {
            let to = pipe
                .stages()
                .iter()
                .find(|s| s.skips.incoming.iter().any(|(i, _)| *i == id))
                .unwrap()
                .index;
            to - from
        })
        .collect();
    v.sort();
    v
}

#[test]
fn the_equivalence_model_has_skips_spanning_one_two_and_three_stages() {
    // What the equivalence grid runs skip_model through (even balance).
    assert_eq!(spans(1, ScheduleKind::GPipe), Vec::<usize>::new());
    assert_eq!(spans(3, ScheduleKind::GPipe), vec![1, 1, 2]);
    assert_eq!(spans(4, ScheduleKind::GPipe), vec![1, 1, 3]);
    assert_eq!(spans(4, ScheduleKind::ZbV), vec![2, 3, 5]);
}

fn build_error(layers: Vec<Box<dyn Module>>) -> String {
    let cfg = PipeCfg::new(2, 2, CheckpointMode::Never, ScheduleKind::GPipe);
    match try_sim_pipeline(layers, &cfg) {
        Ok(_) => panic!("built a pipeline with unpaired skips"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn unpaired_skips_are_build_errors_naming_both_layers() {
    let lin = || -> Box<dyn Module> { Box::new(Linear::new(W, W, 1, &Device::cpu()).unwrap()) };
    let e = build_error(vec![lin(), Box::new(SkipLayer::new().pop("x")), lin()]);
    assert!(
        e.contains("layer 1") && e.contains("'x'") && e.contains("no layer stashes"),
        "{e}"
    );

    let e = build_error(vec![lin(), Box::new(SkipLayer::new().stash("x")), lin()]);
    assert!(
        e.contains("layer 1") && e.contains("no later layer pops"),
        "{e}"
    );

    let e = build_error(vec![
        Box::new(SkipLayer::new().stash("x")),
        Box::new(SkipLayer::new().stash("x")),
        Box::new(SkipLayer::new().pop("x")),
    ]);
    assert!(
        e.contains("layer 0") && e.contains("layer 1") && e.contains("both stash"),
        "{e}"
    );

    let e = build_error(vec![
        Box::new(SkipLayer::new().pop("x")),
        lin(),
        Box::new(SkipLayer::new().stash("x")),
    ]);
    assert!(
        e.contains("layer 0") && e.contains("layer 2") && e.contains("before"),
        "{e}"
    );
}

/// AmoebaNet-D's cells read h_(i-2) through skips: pipelined training of a small one equals
/// plain training (M = 1, so batch-norm statistics are those of the whole batch).
#[test]
fn amoebanet_d_pipelined_equals_plain() {
    use wgpipe_models::AmoebaNet;
    let net = AmoebaNet {
        normal_cells: 1,
        filters: 4,
        num_classes: 3,
        in_channels: 3,
    };
    let make = || net.build(5, &Device::cpu()).unwrap();
    let x = normal_data(&[4, 3, 8, 8], 8);
    let y = wgpipe_tensor::Tensor::from_vec(vec![0., 1., 2., 1.], &[4], &Device::cpu()).unwrap();
    let reference = plain_train(&make(), &x, &y, &cross_entropy, 2);
    let mut ran = 0;
    for k in [2, 4] {
        for schedule in ALL_SCHEDULES {
            if !runs(schedule, k, 1, make().len()) {
                continue;
            }
            for mode in [CheckpointMode::Always, CheckpointMode::Never] {
                let cfg = PipeCfg::new(k, 1, mode, schedule);
                let mut pipe = sim_pipeline(make(), &cfg);
                let (got, _) = pipe_train(&mut pipe, &x, &y, &cross_entropy, 2);
                assert_close(
                    &got,
                    &reference,
                    1e-5,
                    &format!("K={k} {mode} {schedule:?}"),
                );
                ran += 1;
            }
        }
    }
    assert_eq!(
        ran,
        2 * 2 * (ALL_SCHEDULES.len() - 1),
        "every schedule but DualPipeV (M >= 2K) at K = 2 and 4"
    );
}

#[test]
fn a_skips_bytes_count_at_its_consumer_in_cost_and_memory_balance() {
    // skip_model on [8, 6]: a (1 -> 4), c (4 -> 6), b (2 -> 7), each shaped like the input.
    let bytes = 8 * 6 * 4;
    let popped = wgpipe_pipeline::skips::popped_bytes(&skip_model(1), &[8, 6]).unwrap();
    assert_eq!(popped, vec![0, 0, 0, 0, bytes, 0, bytes, bytes, 0]);

    // Balance by memory over 2 stages: the layer popping the SKIPS skips costs their bytes
    // (4 x 512, more than a Linear(16, 16)'s 1088 + 512), so its stage takes fewer layers
    // than without them.
    let balance = |with_skip: bool| {
        let cluster =
            wgpipe_pipeline::SimCluster::uniform(&Device::cpu(), 2, u64::MAX, 1e9, LinkSpec::FREE);
        let pipe = wgpipe_pipeline::Pipeline::builder(long_skip(with_skip))
            .sim(cluster)
            .balance(wgpipe_pipeline::Balance::ByMemory {
                input_shape: vec![N, W],
                optimizer_factor: 1.0,
            })
            .build()
            .unwrap();
        let b = pipe.balance();
        let consumer = pipe
            .stages()
            .iter()
            .position(|s| (s.first_layer..s.first_layer + s.layers.len()).contains(&4))
            .unwrap();
        (b.clone(), b[consumer])
    };
    let (with, at_with) = balance(true);
    let (without, at_without) = balance(false);
    assert!(
        at_with < at_without,
        "balance {with:?} with the skips, {without:?} without"
    );
}

#[test]
fn a_measured_balance_profiles_layers_with_their_skips() {
    // Each layer runs alone on what the layers before it made, popped skips included.
    let cluster =
        wgpipe_pipeline::SimCluster::uniform(&Device::cpu(), 3, u64::MAX, 1e9, LinkSpec::FREE);
    let pipe = wgpipe_pipeline::Pipeline::builder(skip_model(1))
        .sim(cluster)
        .balance(wgpipe_pipeline::Balance::ByTime {
            sample: normal_data(&[4, 6], 1),
        })
        .build()
        .unwrap();
    assert_eq!(pipe.balance().iter().sum::<usize>(), 9);
}

#[test]
fn skips_cross_the_wire_format() {
    // Loopback encodes every message (skip links included) as a multi-process transport would.
    let x = normal_data(&[8, 6], 1);
    let y = normal_data(&[8, 3], 2);
    let reference = plain_train(&skip_model(21), &x, &y, &mse, 2);
    for schedule in [ScheduleKind::OneFOneB, ScheduleKind::ZbV] {
        let mut cfg = PipeCfg::new(4, 8, CheckpointMode::ExceptLast, schedule);
        cfg.transport = wgpipe_pipeline::Transport::Loopback;
        let mut pipe = sim_pipeline(skip_model(21), &cfg);
        let (got, _) = pipe_train(&mut pipe, &x, &y, &mse, 2);
        assert_close(
            &got,
            &reference,
            1e-5,
            &format!("{schedule:?} over Loopback"),
        );
    }
}

/// `skip_model` trained pipelined with its skips routed as `route`.
fn train_routed(
    k: usize,
    schedule: ScheduleKind,
    mode: CheckpointMode,
    route: SkipRoute,
) -> (RunResult, Pipeline) {
    let x = normal_data(&[8, 6], 1);
    let y = normal_data(&[8, 3], 2);
    let mut cfg = PipeCfg::new(k, 4, mode, schedule);
    cfg.skip_route = route;
    let mut pipe = sim_pipeline(skip_model(21), &cfg);
    let (got, _) = pipe_train(&mut pipe, &x, &y, &mse, 2);
    (got, pipe)
}

#[test]
fn relayed_skips_train_as_plain_and_bit_identical_to_direct_ones() {
    let x = normal_data(&[8, 6], 1);
    let y = normal_data(&[8, 3], 2);
    let reference = plain_train(&skip_model(21), &x, &y, &mse, 2);
    let schedules = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::ZbH1,
        ScheduleKind::Interleaved1F1B,
        ScheduleKind::ZbV,
    ];
    let mut relayed_hops = 0;
    for k in [3, 4] {
        for schedule in schedules {
            for mode in ALL_MODES {
                let what = format!("K={k} {schedule:?} {mode}");
                let (direct, _) = train_routed(k, schedule, mode, SkipRoute::Direct);
                let (relay, pipe) = train_routed(k, schedule, mode, SkipRoute::Relay);
                assert_close(&relay, &reference, 1e-5, &what);
                assert_eq!(relay, direct, "{what}: relayed differs from direct");
                // Every skip transfer is between neighbouring stages.
                for (_, a) in pipe.schedule().actions() {
                    if let Some(p) = a.skip {
                        assert_eq!(a.stage.abs_diff(p.peer), 1, "{what}: {a}");
                        relayed_hops += 1;
                    }
                }
                // Some stage passes a skip on (it receives and sends one of the same name).
                let passes = pipe.stages().iter().any(|s| {
                    s.skips
                        .incoming
                        .iter()
                        .any(|(_, n)| s.skips.outgoing.iter().any(|(_, o)| o == n))
                });
                assert!(passes, "{what}: no skip spans more than one stage here");
            }
        }
    }
    assert!(relayed_hops > 0);
}

#[test]
fn a_relayed_skip_goes_through_the_stage_between() {
    let x = normal_data(&[N, W], 3);
    let y = normal_data(&[N, W], 4);
    let skip_bytes = (SKIPS * N * W * 4) as u64;
    let run = |with_skip: bool, route: SkipRoute| {
        let mut cfg = PipeCfg::new(3, 1, CheckpointMode::ExceptLast, ScheduleKind::GPipe)
            .balance(vec![2, 2, 2]);
        cfg.skip_route = route;
        let mut pipe = sim_pipeline(long_skip(with_skip), &cfg);
        pipe.train_step(&x, &y, &mse).unwrap()
    };
    let without = run(false, SkipRoute::Relay);
    let relay = run(true, SkipRoute::Relay);
    let sent = |r: &StepReport, s: usize| r.stages[s].bytes_sent;
    // Stage 0 sends the skips to stage 1, which sends them on and their gradients back; stage 2
    // sends the gradients to stage 1.
    assert_eq!(sent(&relay, 0), sent(&without, 0) + skip_bytes);
    assert_eq!(sent(&relay, 1), sent(&without, 1) + 2 * skip_bytes);
    assert_eq!(sent(&relay, 2), sent(&without, 2) + skip_bytes);
    let sim = relay.simulated.as_ref().unwrap();
    let hops: Vec<_> = sim
        .timeline
        .events
        .iter()
        .filter(|e| matches!(e.kind, ActionKind::SendSkip | ActionKind::SendSkipGrad))
        .map(|e| (e.device, e.peer.unwrap()))
        .collect();
    assert_eq!(hops.len(), 2 * 2 * SKIPS, "two hops each way per skip");
    assert!(hops.iter().all(|&(a, b)| a.abs_diff(b) == 1), "{hops:?}");
    // The direct route skips stage 1.
    let direct = run(true, SkipRoute::Direct);
    assert_eq!(sent(&direct, 1), sent(&without, 1));
}

#[test]
fn the_planner_refuses_relayed_skips() {
    let cluster = wgpipe_pipeline::SimCluster::new(
        &Device::cpu(),
        &[wgpipe_pipeline::DeviceSpec {
            flops_per_sec: 1e9,
            memory_bytes: u64::MAX,
        }],
        LinkSpec::FREE,
    );
    let x = normal_data(&[8, 6], 1);
    let y = normal_data(&[8, 3], 2);
    let inputs = wgpipe_pipeline::plan::PlanInputs {
        inputs: &x,
        targets: &y,
        loss: &mse,
        batch: 8,
        options: Default::default(),
    };
    let e = match Pipeline::builder(skip_model(1))
        .skip_route(SkipRoute::Relay)
        .plan(&cluster, &inputs)
    {
        Ok(_) => panic!("planned a relaying builder"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("direct skips only"), "{e}");
}
