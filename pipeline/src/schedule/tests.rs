//! Generators, validation, text and the memory closed forms of every schedule (the bubble
//! closed forms are checked by simulation, in `sim/schedule_timelines.rs`).

use super::random::{random_schedule, Rng};
use super::*;

const MODES: [CheckpointMode; 3] = [
    CheckpointMode::Always,
    CheckpointMode::ExceptLast,
    CheckpointMode::Never,
];

type Generator = fn(usize, usize, CheckpointMode) -> Result<Schedule, ScheduleError>;

fn interleaved2(k: usize, m: usize, mode: CheckpointMode) -> Result<Schedule, ScheduleError> {
    interleaved_one_f_one_b(k, 2, m, mode)
}
fn interleaved3(k: usize, m: usize, mode: CheckpointMode) -> Result<Schedule, ScheduleError> {
    interleaved_one_f_one_b(k, 3, m, mode)
}
fn bfs2(k: usize, m: usize, mode: CheckpointMode) -> Result<Schedule, ScheduleError> {
    looped_bfs(k, 2, m, mode)
}

const GENERATORS: [(&str, Generator); 9] = [
    ("gpipe", gpipe),
    ("1f1b", one_f_one_b),
    ("interleaved v=2", interleaved2),
    ("interleaved v=3", interleaved3),
    ("looped bfs v=2", bfs2),
    ("zb-h1", zb_h1),
    ("zb-h2", zb_h2),
    ("zb-v", zb_v),
    ("dualpipe-v", dual_pipe_v),
];

/// Every generator for K in 1..=8, M in 1..=12 and every mode (DualPipeV where M >= 2K).
fn each_schedule(mut f: impl FnMut(&str, &Schedule)) {
    for (name, g) in GENERATORS {
        for k in 1..=8 {
            for m in 1..=12 {
                for mode in MODES {
                    match g(k, m, mode) {
                        Ok(s) => f(name, &s),
                        Err(ScheduleError::NeedsMicroBatches { .. }) if name == "dualpipe-v" => {
                            assert!(m < 2 * k)
                        }
                        Err(e) => panic!("{name} K={k} M={m} {mode}: {e}"),
                    }
                }
            }
        }
    }
}

#[test]
fn generators_reject_empty_sizes() {
    for (_, g) in GENERATORS {
        let never = CheckpointMode::Never;
        assert_eq!(g(0, 4, never), Err(ScheduleError::NoDevices));
        assert_eq!(g(4, 0, never), Err(ScheduleError::NoMicroBatches));
    }
}

#[test]
fn generated_schedules_validate_and_hold_their_declared_memory() {
    let mut count = 0;
    each_schedule(|name, s| {
        s.validate().unwrap_or_else(|e| panic!("{name}: {e}"));
        if let Some(limit) = &s.in_flight_limit {
            let found = s.max_in_flight();
            assert!(
                found.iter().zip(limit).all(|(f, l)| f <= l),
                "{name}: {found:?} > {limit:?}"
            );
        }
        count += 1;
    });
    assert!(count > 2000, "{count}");
}

#[test]
fn dual_pipe_v_names_its_condition() {
    let e = dual_pipe_v(4, 7, CheckpointMode::Never).unwrap_err();
    assert!(
        e.to_string().contains("at least 8 micro-batches, got 7"),
        "{e}"
    );
}

#[test]
fn gpipe_two_stages_exact_lists() {
    let s = gpipe(2, 2, CheckpointMode::ExceptLast).unwrap();
    let text: Vec<String> = s
        .devices
        .iter()
        .map(|l| {
            l.iter()
                .map(Action::to_string)
                .collect::<Vec<_>>()
                .join(",")
        })
        .collect();
    assert_eq!(
        text[0],
        "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B1,0B1,0R0,0RECV_B0,0B0"
    );
    assert_eq!(
        text[1],
        "1RECV_F0,1F0,1RECV_F1,1F1,1B1,1SEND_B1,1R0,1B0,1SEND_B0"
    );
}

fn computes(s: &Schedule, d: usize) -> String {
    s.devices[d]
        .iter()
        .filter(|a| a.is_compute())
        .map(|a| s.cell_label(*a))
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn one_f_one_b_three_stages_exact_order() {
    let s = one_f_one_b(3, 4, CheckpointMode::Never).unwrap();
    assert_eq!(computes(&s, 0), "F0 F1 F2 B0 F3 B1 B2 B3");
    assert_eq!(computes(&s, 1), "F0 F1 B0 F2 B1 F3 B2 B3");
    assert_eq!(computes(&s, 2), "F0 B0 F1 B1 F2 B2 F3 B3");
}

#[test]
fn interleaved_follows_megatron_order() {
    // K=2, v=2, M=4: device 0 warms up with 2(K-1) + (v-1)K = 4 chunk forwards.
    let s = interleaved_one_f_one_b(2, 2, 4, CheckpointMode::Never).unwrap();
    assert_eq!(s.placement, vec![0, 1, 0, 1]);
    assert_eq!(
        computes(&s, 0),
        "F0c0 F1c0 F0c1 F1c1 F2c0 B0c1 F3c0 B1c1 F2c1 B0c0 F3c1 B1c0 B2c1 B3c1 B2c0 B3c0"
    );
}

#[test]
fn zb_h1_alternates_forward_and_input_and_fills_with_weights() {
    let s = zb_h1(2, 4, CheckpointMode::Never).unwrap();
    assert_eq!(computes(&s, 0), "F0 F1 I0 W0 F2 I1 W1 F3 I2 W2 I3 W3");
    assert_eq!(computes(&s, 1), "F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3");
}

#[test]
fn placements() {
    assert_eq!(Placement::V.devices(3), vec![0, 1, 2, 2, 1, 0]);
    assert_eq!(
        Placement::Looped { chunks: 2 }.devices(3),
        vec![0, 1, 2, 0, 1, 2]
    );
    let s = zb_v(3, 6, CheckpointMode::Never).unwrap();
    assert_eq!(s.stages_of(0), vec![0, 5]);
    assert_eq!(s.chunk_of(5), 1);
    // The V's turn is a hand-over inside device 2: its link has both ends there.
    let turn = Link {
        from: 2,
        to: 3,
        grad: false,
        skip: None,
    };
    assert!(s.links().contains(&turn));
    assert_eq!((s.placement[turn.from], s.placement[turn.to]), (2, 2));
}

#[test]
fn in_flight_counts() {
    let never = CheckpointMode::Never;
    for k in 1..=6usize {
        for m in 1..=9usize {
            assert_eq!(gpipe(k, m, never).unwrap().max_in_flight(), vec![m; k]);
            let o: Vec<usize> = (0..k).map(|j| (k - j).min(m)).collect();
            assert_eq!(
                one_f_one_b(k, m, never).unwrap().max_in_flight(),
                o,
                "K={k} M={m}"
            );
            assert!(zb_h1(k, m, never)
                .unwrap()
                .max_in_flight()
                .iter()
                .all(|&x| x <= k.min(m)));
            assert_eq!(
                looped_bfs(k, 2, m, never).unwrap().max_in_flight(),
                vec![2 * m; k]
            );
            assert!(zb_v(k, m, never)
                .unwrap()
                .max_in_flight()
                .iter()
                .all(|&x| x <= 2 * k));
        }
    }
    // ZB-H1 keeps 1F1B's first-device peak on every device; ZB-H2 about twice it.
    assert_eq!(zb_h1(4, 8, never).unwrap().max_in_flight(), vec![4; 4]);
    assert_eq!(zb_h2(4, 8, never).unwrap().max_in_flight(), vec![7; 4]);
}

#[test]
fn grid_holds_every_compute_action_once() {
    each_schedule(|_, s| {
        for (d, row) in s.clock_grid().iter().enumerate() {
            let placed: Vec<Action> = row.iter().flatten().copied().collect();
            let listed: Vec<Action> = s.devices[d]
                .iter()
                .copied()
                .filter(|a| a.is_compute())
                .collect();
            assert_eq!(placed, listed);
        }
    });
}

#[test]
fn display_prints_grid() {
    let text = gpipe(2, 3, CheckpointMode::Never).unwrap().to_string();
    let expected = "gpipe: K=2 devices, 2 stages, M=3 micro-batches, 0 recomputes\n\
                    device 0 | F0 F1 F2 .. .. B2 B1 B0\n\
                    device 1 | .. F0 F1 F2 B2 B1 B0 ..\n";
    assert_eq!(text, expected);
    let text = zb_v(2, 2, CheckpointMode::Never).unwrap().to_string();
    assert!(text.contains("I0c1") && text.contains("W0c0"), "{text}");
}

#[test]
fn text_round_trips_and_compute_only_listings_get_transfers() {
    each_schedule(|name, s| {
        if s.num_devices() <= 4 && s.num_micro_batches <= 5 {
            let mut back = Schedule::parse(&s.to_text()).unwrap_or_else(|e| panic!("{name}: {e}"));
            back.in_flight_limit = s.in_flight_limit.clone();
            assert_eq!(&back, s);
        }
    });
    let s = Schedule::parse("# micro_batches: 2\n0F0,0F1,0B1,0B0\n1F0,1B0,1F1,1B1\n").unwrap();
    assert_eq!(s, {
        let mut g = one_f_one_b(2, 2, CheckpointMode::Never).unwrap();
        g.devices[0] = gpipe(2, 2, CheckpointMode::Never).unwrap().devices[0].clone();
        g.name = "custom".into();
        g.in_flight_limit = None;
        g
    });
}

#[test]
fn parse_errors_name_the_line_and_token() {
    let e = Schedule::parse("0F0,0X1\n").unwrap_err();
    assert!(
        e.to_string().contains("line 1: '0X1': unknown action 'X'"),
        "{e}"
    );
    let e = Schedule::parse("# placement: 0,a\n0F0,0B0\n").unwrap_err();
    assert!(e.to_string().contains("line 1: placement entry 'a'"), "{e}");
    let e = Schedule::parse("F0\n").unwrap_err();
    assert!(e.to_string().contains("missing or bad stage"), "{e}");
}

fn two_stage() -> Schedule {
    gpipe(2, 2, CheckpointMode::Never).unwrap()
}

fn act(kind: ActionKind, stage: usize, m: usize) -> Action {
    Action::new(kind, stage, m)
}

#[test]
fn rejects_bad_shapes_and_placements() {
    let mut s = two_stage();
    s.placement = vec![0, 2];
    assert!(s
        .validate()
        .unwrap_err()
        .to_string()
        .contains("stage 1 is placed on device 2"));
    let mut s = two_stage();
    s.placement = vec![0, 0];
    assert_eq!(s.validate(), Err(ScheduleError::IdleDevice { device: 1 }));
    let mut s = two_stage();
    s.devices[0].push(act(ActionKind::Forward, 0, 7));
    let e = s.validate().unwrap_err();
    assert!(
        e.to_string()
            .contains("device 0: 0F7 names a stage or micro-batch outside"),
        "{e}"
    );
    let mut s = two_stage();
    s.devices[0].insert(0, act(ActionKind::Forward, 1, 0));
    let e = s.validate().unwrap_err();
    assert!(
        e.to_string()
            .contains("1F0 belongs to stage 1, which is placed on device 1"),
        "{e}"
    );
    let mut s = two_stage();
    s.devices[0].insert(0, act(ActionKind::RecvActivation, 0, 0));
    let e = s.validate().unwrap_err();
    assert!(e.to_string().contains("0RECV_F0 has no peer"), "{e}");
}

#[test]
fn rejects_missing_duplicate_and_mixed_actions() {
    let mut s = two_stage();
    s.devices[1].retain(|a| *a != act(ActionKind::Backward, 1, 0));
    assert_eq!(
        s.validate(),
        Err(ScheduleError::ActionCount {
            device: 1,
            action: act(ActionKind::Backward, 1, 0),
            found: 0,
            expected: 1
        })
    );
    let mut s = two_stage();
    s.devices[0].insert(0, act(ActionKind::Forward, 0, 1));
    assert!(s
        .validate()
        .unwrap_err()
        .to_string()
        .contains("0F1 occurs 2 times, expected 1"));
    let mut s = two_stage();
    s.devices[0].push(act(ActionKind::BackwardWeight, 0, 0));
    assert!(matches!(
        s.validate(),
        Err(ScheduleError::MixedBackward {
            device: 0,
            stage: 0,
            micro_batch: 0
        })
    ));
}

#[test]
fn rejects_wrong_orders() {
    let mut s = gpipe(1, 1, CheckpointMode::Never).unwrap();
    s.devices[0].reverse();
    assert_eq!(
        s.validate().unwrap_err().to_string(),
        "device 0: 0F0 must come before 0B0"
    );
    let mut s = zb_h1(1, 1, CheckpointMode::Never).unwrap();
    s.devices[0] = vec![
        act(ActionKind::Forward, 0, 0),
        act(ActionKind::BackwardWeight, 0, 0),
        act(ActionKind::BackwardInput, 0, 0),
    ];
    assert_eq!(
        s.validate().unwrap_err().to_string(),
        "device 0: 0I0 must come before 0W0"
    );
    let mut s = gpipe(1, 1, CheckpointMode::Always).unwrap();
    s.devices[0] = vec![
        act(ActionKind::Forward, 0, 0),
        act(ActionKind::Backward, 0, 0),
        act(ActionKind::Recompute, 0, 0),
    ];
    assert!(
        matches!(s.validate(), Err(ScheduleError::Order { earlier, .. }) if earlier.kind == ActionKind::Recompute)
    );
}

#[test]
fn rejects_exceeding_the_declared_memory() {
    let mut s = gpipe(2, 4, CheckpointMode::Never).unwrap();
    s.in_flight_limit = Some(vec![2, 4]);
    assert_eq!(
        s.validate(),
        Err(ScheduleError::InFlight {
            device: 0,
            found: 4,
            limit: 2
        })
    );
}

#[test]
fn detects_deadlock_and_names_stuck_devices() {
    use ActionKind::*;
    // Device 0 waits for the gradient of micro-batch 0 before sending micro-batch 1, but device
    // 1 only starts backward after both forwards.
    let s = Schedule::parse(
        "0F0,0SEND_F0,0RECV_B0,0B0,0F1,0SEND_F1,0RECV_B1,0B1\n\
         1RECV_F0,1F0,1RECV_F1,1F1,1B0,1SEND_B0,1B1,1SEND_B1\n",
    );
    let e = s.unwrap_err();
    assert_eq!(
        e,
        ScheduleError::Deadlock {
            stuck: vec![(0, act(RecvGrad, 0, 0)), (1, act(RecvActivation, 1, 1))]
        }
    );
    let msg = e.to_string();
    assert!(msg.contains("device 0 waits at 0RECV_B0"), "{msg}");
    assert!(msg.contains("device 1 waits at 1RECV_F1"), "{msg}");
}

// ---------------------------------------------------------------------------------------------
// Fuzz: random valid schedules validate; random broken ones are rejected (never a hang).
// ---------------------------------------------------------------------------------------------

/// Breaks a valid schedule in a way validation must catch; returns what was done.
fn break_schedule(s: &mut Schedule, rng: &mut Rng) -> &'static str {
    let d = rng.below(s.num_devices());
    let i = rng.below(s.devices[d].len());
    match rng.below(5) {
        0 if s.devices[d][i].kind != ActionKind::Recompute => {
            s.devices[d].remove(i);
            "removed an action"
        }
        1 => {
            let a = s.devices[d][i];
            let at = rng.below(s.devices[d].len() + 1);
            s.devices[d].insert(at, a);
            "duplicated an action"
        }
        2 => {
            s.devices[d][i].micro_batch = s.num_micro_batches;
            "micro-batch out of range"
        }
        3 if s.num_devices() > 1 => {
            let a = s.devices[d].remove(i);
            let other = (d + 1) % s.num_devices();
            s.devices[other].push(a);
            "moved an action to another device"
        }
        _ => {
            // Waiting for a gradient (or an activation of a later stage on this device) before
            // anything else: the wait depends on this device's own later work.
            let pos = s
                .devices
                .iter()
                .flatten()
                .position(|a| a.kind == ActionKind::RecvGrad);
            match pos {
                Some(_) => {
                    let (d, i) = s
                        .devices
                        .iter()
                        .enumerate()
                        .find_map(|(d, l)| {
                            l.iter()
                                .position(|a| a.kind == ActionKind::RecvGrad)
                                .map(|i| (d, i))
                        })
                        .unwrap();
                    let a = s.devices[d].remove(i);
                    s.devices[d].insert(0, a);
                    "a gradient receive first (deadlock)"
                }
                None => {
                    s.devices[d][i].micro_batch = s.num_micro_batches;
                    "micro-batch out of range"
                }
            }
        }
    }
}

#[test]
fn fuzz_random_valid_schedules_validate_and_broken_ones_are_rejected() {
    let mut rng = Rng::new(2024);
    let mut split = 0;
    for n in 0..3000 {
        let s = random_schedule(n as u64);
        s.validate()
            .unwrap_or_else(|e| panic!("random schedule {n} rejected: {e}\n{}", s.to_text()));
        split += usize::from(s.splits_backward());
        let mut broken = s.clone();
        let how = break_schedule(&mut broken, &mut rng);
        assert!(
            broken.validate().is_err(),
            "{how} was not caught:\n{}",
            broken.to_text()
        );
        // The simulator and the grid also terminate on broken schedules.
        let _ = broken.clock_grid();
    }
    assert!(split > 1000, "{split}");
}
