//! Reports: bytes between stages, the Chrome trace and the SVG timeline.

use serde_json::Value;
use wgpipe_pipeline::sim::trace::{chrome_trace_json, svg_timeline};
use wgpipe_pipeline::{CheckpointMode, ScheduleKind, StepReport};
use wgpipe_tensor::Tag;
use wgpipe_tests::*;

/// Output width of each layer of `mlp(6, 12, 3)` (input widths are the previous outputs, 6 first).
const MLP_OUT: [usize; 8] = [12, 12, 16, 16, 16, 12, 12, 3];
const MLP_IN: usize = 6;

/// Each stage sends its output activations forward and its input gradients back, and nothing
/// else: N x width x 4 bytes at each boundary, whatever M (even uneven micro-batches).
#[test]
fn bytes_sent_are_the_boundary_activations_and_gradients() {
    for n in [8, 10] {
        let x = normal_data(&[n, MLP_IN], 1);
        let y = normal_data(&[n, 3], 2);
        for (k, balance) in [
            (1, vec![8]),
            (2, vec![3, 5]),
            (3, vec![2, 3, 3]),
            (4, vec![1, 2, 4, 1]),
        ] {
            for m in [1, 4] {
                for schedule in CLASSIC_SCHEDULES {
                    let cfg = PipeCfg::new(k, m, CheckpointMode::ExceptLast, schedule)
                        .balance(balance.clone());
                    let mut pipe = sim_pipeline(mlp(MLP_IN, 12, 3, 11), &cfg);
                    let r = pipe.train_step(&x, &y, &mse).unwrap();
                    let mut start = 0;
                    let mut total = 0;
                    for (j, &len) in balance.iter().enumerate() {
                        let end = start + len;
                        let mut want = 0;
                        if j + 1 < k {
                            want += n * MLP_OUT[end - 1] * 4; // activations forward
                        }
                        if j > 0 {
                            want += n * MLP_OUT[start - 1] * 4; // input gradients back
                        }
                        assert_eq!(
                            r.stages[j].bytes_sent as usize, want,
                            "N={n} K={k} M={m} {schedule:?} stage {j}"
                        );
                        total += want;
                        start = end;
                    }
                    assert_eq!(r.bytes_sent() as usize, total);
                    // The simulated timeline carries one transfer per send.
                    let sim = r.simulated.as_ref().unwrap();
                    let transfers = sim
                        .timeline
                        .events
                        .iter()
                        .filter(|e| !e.kind.is_compute())
                        .count();
                    assert_eq!(transfers, 2 * (k - 1) * m);
                }
            }
        }
    }
    // A Transformer boundary carries [n, T, d] activations and gradients.
    let (t, d) = (transformer_cfg(0.0).seq_len, transformer_cfg(0.0).d_model);
    let cfg =
        PipeCfg::new(2, 4, CheckpointMode::Always, ScheduleKind::OneFOneB).balance(vec![2, 3]);
    let mut pipe = sim_pipeline(transformer(0.0, 3), &cfg);
    let r = pipe
        .train_step(
            &token_ids(8, t, 16, 0),
            &token_ids(8, t, 16, 1),
            &cross_entropy,
        )
        .unwrap();
    assert_eq!(r.stages[0].bytes_sent as usize, 8 * t * d * 4);
    assert_eq!(r.stages[1].bytes_sent as usize, 8 * t * d * 4);
}

fn sample_report(mode: CheckpointMode, k: usize, m: usize) -> StepReport {
    let x = normal_data(&[8, MLP_IN], 1);
    let y = normal_data(&[8, 3], 2);
    let mut pipe = sim_pipeline(
        mlp(MLP_IN, 12, 3, 11),
        &PipeCfg::new(k, m, mode, ScheduleKind::GPipe),
    );
    pipe.train_step(&x, &y, &mse).unwrap()
}

fn count_names(events: &[Value], letter: char) -> usize {
    events
        .iter()
        .filter(|e| e["ph"] == "X")
        .filter(|e| e["name"].as_str().is_some_and(|n| n.starts_with(letter)))
        .count()
}

#[test]
fn chrome_trace_parses_and_holds_every_event() {
    let (k, m) = (3, 4);
    let r = sample_report(CheckpointMode::Always, k, m);
    let sim = r.simulated.as_ref().unwrap();
    let json = chrome_trace_json(&sim.timeline, "test step");
    let v: Value = serde_json::from_str(&json).expect("valid JSON");
    let events = v["traceEvents"].as_array().expect("traceEvents");
    assert_eq!(v["otherData"]["clock"], "simulated");
    let complete: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(complete.len(), sim.timeline.events.len());
    for e in &complete {
        assert!(e["ts"].as_f64().unwrap() >= 0.0);
        assert!(e["dur"].as_f64().unwrap() >= 0.0);
        let tid = e["tid"].as_u64().unwrap() as usize;
        assert!(tid < k + 2 * (k - 1));
    }
    assert_eq!(count_names(events, 'F'), k * m);
    assert_eq!(count_names(events, 'B'), k * m);
    assert_eq!(count_names(events, 'R'), k * m); // Always: every micro-batch recomputed
    assert_eq!(count_names(events, 'A'), (k - 1) * m);
    assert_eq!(count_names(events, 'G'), (k - 1) * m);
    // The last event ends at the makespan (microseconds).
    let end = complete
        .iter()
        .map(|e| e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap())
        .fold(0.0, f64::max);
    assert!((end - sim.makespan_secs * 1e6).abs() <= 1e-6 * end.max(1.0));

    // The report's own trace: simulated here; measured (and labelled so) without a cluster.
    let v: Value = serde_json::from_str(&r.chrome_trace_json("x")).unwrap();
    assert_eq!(v["otherData"]["clock"], "simulated");
    let mut wall = r.clone();
    wall.simulated = None;
    let v: Value = serde_json::from_str(&wall.chrome_trace_json("x")).unwrap();
    assert_eq!(v["otherData"]["clock"], "wall clock");
    let n = v["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X")
        .count();
    assert_eq!(n, r.wall_timeline.events.len());
    assert!(!wall.svg_timeline("x").contains("simulated"));
}

#[test]
fn svg_timeline_draws_every_event() {
    let (k, m) = (2, 4);
    let r = sample_report(CheckpointMode::ExceptLast, k, m);
    let sim = r.simulated.as_ref().unwrap();
    let svg = svg_timeline(&sim.timeline, "GPipe K=2 M=4 <test>");
    assert!(svg.starts_with("<?xml") && svg.trim_end().ends_with("</svg>"));
    assert!(
        svg.contains("GPipe K=2 M=4 &lt;test&gt;"),
        "title is escaped"
    );
    assert!(svg.contains("simulated"));
    // One box per event, plus the legend's.
    let boxes = svg.matches("<rect").count() - svg.matches(r#"class="legend""#).count();
    assert!(
        boxes >= sim.timeline.events.len(),
        "{boxes} boxes for {} events",
        sim.timeline.events.len()
    );
    // ExceptLast: recomputes for all but the last micro-batch, on every stage.
    let recomputes = sim
        .timeline
        .events
        .iter()
        .filter(|e| e.kind == wgpipe_pipeline::ActionKind::Recompute)
        .count();
    assert_eq!(recomputes, k * (m - 1));
    for kind in ["forward", "backward", "recompute", "transfer"] {
        assert!(svg.contains(kind), "legend lacks {kind}");
    }
}

/// Memory by kind: parameters and gradients are those of the stage's layers; SGD with momentum
/// adds one buffer per parameter; the stage table shows them.
#[test]
fn memory_is_split_by_kind() {
    let x = normal_data(&[8, MLP_IN], 1);
    let y = normal_data(&[8, 3], 2);
    let cfg = PipeCfg::new(2, 4, CheckpointMode::Always, ScheduleKind::GPipe).balance(vec![3, 5]);
    let mut pipe = sim_pipeline(mlp(MLP_IN, 12, 3, 11), &cfg);
    let r = pipe.train_step(&x, &y, &mse).unwrap();
    pipe.optimizer_step().unwrap();
    for (j, s) in r.stages.iter().enumerate() {
        let bytes = s.num_params * 4;
        assert_eq!(s.memory.peak_of(Tag::Parameters), bytes, "stage {j}");
        assert_eq!(
            s.memory.live_of(Tag::Gradients),
            bytes,
            "stage {j} accumulated gradients"
        );
        assert!(s.memory.peak_of(Tag::Activations) > 0);
        let dev = &pipe.devices()[j];
        assert_eq!(
            dev.memory_stats().live_of(Tag::OptimizerState),
            bytes,
            "momentum buffers"
        );
        assert_eq!(
            dev.memory_stats().live_of(Tag::Gradients),
            0,
            "cleared after the step"
        );
        assert_eq!(
            dev.memory_stats().live_of(Tag::Activations),
            0,
            "nothing left over"
        );
    }
    let table = r.stage_table();
    assert!(table.contains("sim0") && table.contains("sim1") && table.contains("simulated"));
}
