//! The open schedule runtime end to end: K = 8 in simulation for every schedule, random valid
//! schedules executed against plain training, user schedules through the builder, activation
//! memory per device against each schedule's micro-batches in flight, and chunks and split
//! backward in the reports.

use wgpipe_autograd::Module;
use wgpipe_models::{Linear, Relu};
use wgpipe_pipeline::schedule::random::random_schedule;
use wgpipe_pipeline::{
    Balance, CheckpointMode, LinkSpec, Pipeline, PipelineError, Schedule, ScheduleKind, SimCluster,
};
use wgpipe_tensor::{Device, Tag};
use wgpipe_tests::*;

/// `n` blocks of [Linear(w, w), ReLU]: 2n layers of equal cost.
fn deep_mlp(n: usize, w: usize, seed: u64) -> Vec<Box<dyn Module>> {
    let d = Device::cpu();
    (0..n)
        .flat_map(|i| -> [Box<dyn Module>; 2] {
            [
                Box::new(Linear::new(w, w, seed + i as u64, &d).unwrap()),
                Box::new(Relu),
            ]
        })
        .collect()
}

#[test]
fn every_schedule_on_eight_devices_equals_plain() {
    let (x, y) = (normal_data(&[16, 6], 3), normal_data(&[16, 6], 4));
    let make = || deep_mlp(8, 6, 40);
    let reference = plain_train(&make(), &x, &y, &mse, 2);
    for schedule in ALL_SCHEDULES {
        for m in [8, 16] {
            if !runs(schedule, 8, m, 16) {
                continue;
            }
            for mode in [CheckpointMode::ExceptLast, CheckpointMode::Never] {
                let cfg = PipeCfg::new(8, m, mode, schedule);
                let mut pipe = sim_pipeline(make(), &cfg);
                let (got, _) = pipe_train(&mut pipe, &x, &y, &mse, 2);
                assert_close(
                    &got,
                    &reference,
                    1e-5,
                    &format!("K=8 M={m} {mode} {schedule:?}"),
                );
            }
        }
    }
}

/// A pipeline over `layers` running `schedule` on one simulated CPU device per schedule device.
fn custom_pipeline(layers: Vec<Box<dyn Module>>, schedule: Schedule) -> Pipeline {
    let n = layers.len();
    let k = schedule.num_devices();
    let s = schedule.num_stages();
    Pipeline::builder(layers)
        .sim(SimCluster::uniform(
            &Device::cpu(),
            k,
            u64::MAX,
            1e9,
            LinkSpec::FREE,
        ))
        .balance(Balance::Explicit(even_balance(n, s)))
        .schedule(schedule)
        .seed(SEED)
        .optimizer(sgd)
        .build()
        .unwrap()
}

/// Random valid schedules (random K, chunk placements, M, orders, split or full backward and
/// recomputes) run on the simulated cluster to the result of plain training: the executor only
/// walks the lists, whatever they hold.
#[test]
fn random_valid_schedules_train_like_plain() {
    let make = || deep_mlp(6, 4, 90);
    let mut split = 0;
    let mut chunked = 0;
    for seed in 0..1000u64 {
        let schedule = random_schedule(seed);
        let m = schedule.num_micro_batches;
        let n = 2 * m + 1 + (seed as usize % 3);
        let (x, y) = (normal_data(&[n, 4], seed), normal_data(&[n, 4], seed + 1));
        split += usize::from(schedule.splits_backward());
        chunked += usize::from(schedule.max_chunks() > 1);
        let text = schedule.to_text();
        let mut pipe = custom_pipeline(make(), schedule);
        let reference = plain_train(&make(), &x, &y, &mse, 1);
        let (got, _) = pipe_train(&mut pipe, &x, &y, &mse, 1);
        assert_close(
            &got,
            &reference,
            1e-5,
            &format!("random schedule {seed}:\n{text}"),
        );
    }
    assert!(
        split > 300 && chunked > 300,
        "split {split}, chunked {chunked}"
    );
}

#[test]
fn user_schedules_go_through_the_builder_and_are_checked() {
    // A hand-written 2-device listing (compute only; the transfers are inserted).
    let text =
        "# name: mine\n# micro_batches: 2\n0F0,0F1,0I0,0I1,0W1,0W0\n1F0,1I0,1F1,1I1,1W0,1W1\n";
    let schedule = Schedule::parse(text).unwrap();
    let (x, y) = (normal_data(&[4, 4], 1), normal_data(&[4, 4], 2));
    let reference = plain_train(&deep_mlp(2, 4, 5), &x, &y, &mse, 2);
    let mut pipe = custom_pipeline(deep_mlp(2, 4, 5), schedule.clone());
    let (got, reports) = pipe_train(&mut pipe, &x, &y, &mse, 2);
    assert_close(&got, &reference, 1e-5, "hand-written schedule");
    assert_eq!(reports[0].stages.len(), 2);

    let build = |k: usize, m: Option<usize>| {
        let mut b = Pipeline::builder(deep_mlp(2, 4, 5))
            .sim(SimCluster::uniform(
                &Device::cpu(),
                k,
                u64::MAX,
                1e9,
                LinkSpec::FREE,
            ))
            .schedule(schedule.clone());
        if let Some(m) = m {
            b = b.micro_batches(m);
        }
        b.build().err().map(|e| e.to_string())
    };
    let e = build(3, None).expect("3 devices for a 2-device schedule");
    assert!(
        e.contains("schedule 'mine' is for 2 devices but 3 were given"),
        "{e}"
    );
    let e = build(2, Some(4)).expect("M differs");
    assert!(
        e.contains("micro_batches(4) differs from schedule 'mine', which has 2"),
        "{e}"
    );

    // A schedule that would hang is refused before anything runs, naming the waits.
    let hang = Schedule {
        devices: vec![
            schedule.devices[0].iter().rev().copied().collect(),
            schedule.devices[1].clone(),
        ],
        ..schedule.clone()
    };
    let e = Pipeline::builder(deep_mlp(2, 4, 5))
        .sim(SimCluster::uniform(
            &Device::cpu(),
            2,
            u64::MAX,
            1e9,
            LinkSpec::FREE,
        ))
        .schedule(hang)
        .build()
        .err()
        .expect("a reversed list is invalid");
    assert!(matches!(e, PipelineError::Schedule(_)), "{e}");
}

#[test]
fn builder_names_schedule_conditions() {
    let build = |schedule: ScheduleKind, k: usize, m: usize, chunks: Option<usize>| {
        let mut b = Pipeline::builder(deep_mlp(8, 4, 5))
            .sim(SimCluster::uniform(
                &Device::cpu(),
                k,
                u64::MAX,
                1e9,
                LinkSpec::FREE,
            ))
            .micro_batches(m)
            .schedule(schedule);
        if let Some(v) = chunks {
            b = b.chunks(v);
        }
        b.build().err().map(|e| e.to_string())
    };
    let e = build(ScheduleKind::DualPipeV, 4, 6, None).expect("M < 2K");
    assert!(
        e.contains("dualpipe-v needs at least 8 micro-batches, got 6"),
        "{e}"
    );
    let e = build(ScheduleKind::ZbV, 2, 4, Some(3)).expect("ZB-V has 2 chunks");
    assert!(
        e.contains("zb-v schedule places exactly 2 chunk(s) per device; 3 were asked for"),
        "{e}"
    );
    assert!(build(ScheduleKind::Interleaved1F1B, 2, 3, Some(4)).is_none());
    assert_eq!(
        build(ScheduleKind::LoopedBfs, 3, 4, Some(3)).as_deref(),
        None,
        "9 stages over 16 layers"
    );
}

/// Peak activation memory of each device, measured by the device's memory accounting, against
/// the number of micro-batches the schedule keeps in flight there: with equal layers and no
/// re-materialization each stashed (stage, micro-batch) holds the same tape, so the peak grows
/// by one tape per micro-batch in flight.
#[test]
fn activation_peaks_follow_micro_batches_in_flight() {
    let k = 2;
    let m = 8;
    let (x, y) = (normal_data(&[16, 32], 5), normal_data(&[16, 32], 6));
    let peaks = |schedule: ScheduleKind, chunks: usize| -> (Vec<usize>, Vec<usize>) {
        let layers = deep_mlp(4, 32, 7);
        let n = layers.len();
        let mut pipe = Pipeline::builder(layers)
            .sim(SimCluster::uniform(
                &Device::cpu(),
                k,
                u64::MAX,
                1e9,
                LinkSpec::FREE,
            ))
            .balance(Balance::Explicit(even_balance(n, k * chunks)))
            .micro_batches(m)
            .checkpoint(CheckpointMode::Never)
            .schedule(schedule)
            .chunks(chunks)
            .optimizer(sgd)
            .build()
            .unwrap();
        let r = pipe.train_step(&x, &y, &mse).unwrap();
        let peak = r
            .stages
            .iter()
            .map(|s| s.memory.peak_of(Tag::Activations))
            .collect();
        (peak, pipe.schedule().max_in_flight())
    };
    // The bytes of one tape, from two schedules that differ only in how many they keep on
    // device 0: a whole stage (GPipe: M, 1F1B: K), and a chunk (looped BFS: vM, interleaved
    // 1F1B: a few); a chunk holds 1 of the stage's 2 blocks but more than half its tape.
    let tape = |a: (&[usize], &[usize]), b: (&[usize], &[usize])| {
        (a.0[0] - b.0[0]) as f64 / (a.1[0] - b.1[0]) as f64
    };
    let (gpipe, gpipe_n) = peaks(ScheduleKind::GPipe, 1);
    let (one_f, one_f_n) = peaks(ScheduleKind::OneFOneB, 1);
    let (bfs, bfs_n) = peaks(ScheduleKind::LoopedBfs, 2);
    let (inter, inter_n) = peaks(ScheduleKind::Interleaved1F1B, 2);
    let stage_tape = tape((&gpipe, &gpipe_n), (&one_f, &one_f_n));
    let chunk_tape = tape((&bfs, &bfs_n), (&inter, &inter_n));
    eprintln!("tape bytes: stage {stage_tape}, chunk {chunk_tape}");
    assert!(stage_tape > 0.0 && chunk_tape > 0.0 && chunk_tape < stage_tape);
    for (schedule, chunks) in [
        (ScheduleKind::GPipe, 1),
        (ScheduleKind::OneFOneB, 1),
        (ScheduleKind::ZbH1, 1),
        (ScheduleKind::ZbH2, 1),
        (ScheduleKind::Interleaved1F1B, 2),
        (ScheduleKind::LoopedBfs, 2),
        (ScheduleKind::ZbV, 2),
    ] {
        let (peak, in_flight) = peaks(schedule, chunks);
        let bytes = if chunks == 1 { stage_tape } else { chunk_tape };
        for d in 0..k {
            let tapes = peak[d] as f64 / bytes;
            eprintln!(
                "{schedule:?} device {d}: peak {} B = {tapes:.2} tapes, {} in flight",
                peak[d], in_flight[d]
            );
            // Slack: the loss's saved tensors on the device of the last stage, and messages
            // not yet taken by their receiver (measured: at most 1.05 tapes).
            assert!(
                (tapes - in_flight[d] as f64).abs() <= 1.25,
                "{schedule:?} device {d}: peak {} B is {tapes:.2} tapes, the schedule keeps {} in flight",
                peak[d],
                in_flight[d]
            );
        }
    }
}

#[test]
fn chunks_and_split_backward_show_in_grid_trace_and_svg() {
    let mut pipe = sim_pipeline(
        deep_mlp(4, 4, 3),
        &PipeCfg::new(2, 4, CheckpointMode::Never, ScheduleKind::ZbV),
    );
    let (x, y) = (normal_data(&[8, 4], 1), normal_data(&[8, 4], 2));
    let r = pipe.train_step(&x, &y, &mse).unwrap();
    let grid = pipe.schedule().to_string();
    assert!(
        grid.contains("F0c0") && grid.contains("I0c1") && grid.contains("W0c1"),
        "{grid}"
    );
    let trace = r.chrome_trace_json("zb-v");
    for name in [
        "\"F0c0\"",
        "\"I0c1\"",
        "\"W3c0\"",
        "\"backward-input\"",
        "\"backward-weight\"",
    ] {
        assert!(trace.contains(name), "trace lacks {name}");
    }
    let svg = r.svg_timeline("zb-v");
    assert!(
        svg.contains("class=\"event backward-input\"")
            && svg.contains("class=\"event backward-weight\"")
    );
    assert!(svg.contains(">0c1<"), "chunk labels in boxes");
    // The V's turn is a hand-over inside device 1: the trace has transfers only between the
    // two devices.
    let stage_table = r.stage_table();
    assert!(stage_table.contains("0..2 + 6..8"), "{stage_table}");
}
